"""The agent trace ``python -m benchmarks.agents`` replays has the published shape (issue 52):
each turn's prompt a prefix of the next, more than 96 % of it, 44 % of sessions starting
subagents that share the system prompt, and an oracle that computes each turn's new tokens."""

from __future__ import annotations

from benchmarks.agents import SUBAGENT_SHARE, Shape, make_trace, oracle_computed


def test_the_trace_has_the_published_shape() -> None:
    shape = Shape()
    trace = make_trace(52, 25, 12, (300, 10_000), shape)
    assert trace == make_trace(52, 25, 12, (300, 10_000), shape)  # deterministic
    system = trace[0].steps[0].prompt[: shape.system]
    shares = []
    for agent in trace + [s for a in trace for subs in a.spawns.values() for s in subs]:
        assert agent.steps[0].prompt[: shape.system] == system  # one agent's system prompt and tools
        for a, b in zip(agent.steps, agent.steps[1:], strict=False):
            assert b.prompt[: len(a.prompt)] == a.prompt  # each prompt extends the last
            shares.append(len(a.prompt) / len(b.prompt))
    assert min(shares[len(shares) // 2 :]) > 0.94 and sum(shares) / len(shares) > 0.96
    with_subagents = [a for a in trace if a.spawns]
    assert len(with_subagents) == round(SUBAGENT_SHARE * 25)
    assert all(
        s.steps[-1].last and not s.steps[0].last for a in with_subagents for subs in a.spawns.values() for s in subs
    )
    # The oracle: the shared system prompt once, then each turn's new tokens.
    expected = -shape.system * (len(trace) - 1)
    for a in trace:
        expected += len(a.steps[-1].prompt)
        for subs in a.spawns.values():
            expected += sum(len(s.steps[-1].prompt) - shape.system for s in subs)
    assert oracle_computed(trace, shape.system) == expected
