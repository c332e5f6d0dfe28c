"""Model identity from GGUF (spec §5) and the DECODE identity gate (spec §4.2)."""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hydra_trio.model import gguf_meta
from hydra_trio.model import identity as ident
from hydra_trio.model.identity import (
    CAP_CODE,
    CAP_MTP,
    CAP_REASONING,
    CAP_TOOL_USE,
    CAP_VISION,
    IdentityMatch,
    ModelIdentity,
    capabilities_from_metadata,
    capability_names,
    compare_identity,
    file_sha256,
    read_identity,
    split_words,
)
from hydra_trio.model.synthetic import build_vocab, write_model

# ---------------------------------------------------------------------------------------------
# Helpers


def write_custom(
    path: Path,
    *,
    arch: str = "llama",
    kv: dict[str, Any] | None = None,
    vocab: tuple[list[str], list[int]] | None = None,
    merges: list[str] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
) -> Path:
    """A GGUF with exactly the keys given (write_model always adds general.name/file_type)."""
    w = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    for key, value in (kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    if vocab is not None:
        tokens, types = vocab
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if tensors is None:
        tensors = {
            "token_embd.weight": np.zeros((16, 8), dtype=np.float32),
            "output_norm.weight": np.ones(8, dtype=np.float32),
        }
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def small_vocab() -> tuple[list[str], list[int]]:
    tokens, _scores, types = build_vocab(300)
    return tokens, types


def resident(**over: Any) -> ModelIdentity:
    base: dict[str, Any] = {
        "model_alias": "qwen-7b",
        "model_path": "/models/qwen-7b.gguf",
        "tokenizer": "gpt2/qwen2",
        "tokenizer_hash": "xxh3:0123456789abcdef",
        "model_name": "Qwen2.5 7B Instruct",
        "model_quant": "Q4_K_M",
        "model_capabilities": CAP_TOOL_USE,
        "architecture": "qwen2",
    }
    base.update(over)
    return ModelIdentity(**base)


def kv_of(r: ModelIdentity, **over: Any) -> dict[str, Any]:
    kv: dict[str, Any] = {"n_past": 12, **r.fields()}
    kv.pop("model_path")
    kv.pop("model_alias")
    kv.update(over)
    return kv


# ---------------------------------------------------------------------------------------------
# Names, alias, path


def test_base_model_name_wins(tmp_path: Path) -> None:
    p = write_model(tmp_path / "m.gguf", name="My Finetune", base_model_name="Llama 3.1 8B")
    assert read_identity(p).model_name == "Llama 3.1 8B"


def test_general_name_without_base(tmp_path: Path) -> None:
    p = write_model(tmp_path / "m.gguf", name="My Finetune")
    assert read_identity(p).model_name == "My Finetune"


def test_stem_fallback(tmp_path: Path) -> None:
    p = write_custom(tmp_path / "mystery-7b.Q8_0.gguf", vocab=small_vocab())
    got = read_identity(p)
    assert got.model_name == "mystery-7b.Q8_0"
    assert got.model_alias == "mystery-7b.Q8_0"


def test_alias_and_path(tmp_path: Path) -> None:
    p = write_model(tmp_path / "tiny-model.gguf")
    got = read_identity(p)
    assert got.model_alias == "tiny-model"
    assert got.model_path == str(p)
    assert isinstance(got.model_path, str)
    assert read_identity(str(p), alias="chat").model_alias == "chat"
    assert got.architecture == "llama"


def test_fields_and_info_fields(tmp_path: Path) -> None:
    p = write_model(tmp_path / "m.gguf", tags=["code"], extra_kv={"llama.nextn_predict_layers": 2})
    got = read_identity(p)
    assert set(got.fields()) == {
        "model_alias",
        "model_path",
        "tokenizer",
        "model_name",
        "model_quant",
        "model_capabilities",
    }
    info = got.info_fields()
    assert info["tokenizer_hash"] == got.tokenizer_hash
    assert info["model_capabilities"] == CAP_MTP | CAP_CODE
    assert info["model_capabilities_names"] == ["MTP", "CODE"]


# ---------------------------------------------------------------------------------------------
# Tokenizer and its hash


def test_tokenizer_without_and_with_pre(tmp_path: Path) -> None:
    assert read_identity(write_model(tmp_path / "a.gguf")).tokenizer == "llama"
    p = write_model(tmp_path / "b.gguf", tokenizer_pre="qwen2")
    assert read_identity(p).tokenizer == "llama/qwen2"


def test_tokenizer_missing_is_none(tmp_path: Path) -> None:
    assert read_identity(write_custom(tmp_path / "n.gguf")).tokenizer == "none"


def test_tokenizer_hash_format_and_equal_for_same_vocab(tmp_path: Path) -> None:
    a = read_identity(write_model(tmp_path / "a.gguf", seed=1, name="A"))
    b = read_identity(write_model(tmp_path / "b.gguf", seed=2, name="B", tokenizer_pre="x"))
    assert re.fullmatch(r"xxh3:[0-9a-f]{16}", a.tokenizer_hash)
    assert a.tokenizer_hash == b.tokenizer_hash  # weights, names and pre are not vocabulary


def test_tokenizer_hash_differs_for_one_token(tmp_path: Path) -> None:
    tokens, _scores, _types = build_vocab(512)
    changed = list(tokens)
    changed[400] = changed[400] + "x"
    a = read_identity(write_model(tmp_path / "a.gguf"))
    b = read_identity(write_model(tmp_path / "b.gguf", extra_kv={"tokenizer.ggml.tokens": changed}))
    assert a.tokenizer == b.tokenizer
    assert a.tokenizer_hash != b.tokenizer_hash


def test_tokenizer_hash_covers_size_types_and_merges(tmp_path: Path) -> None:
    base = read_identity(write_model(tmp_path / "a.gguf")).tokenizer_hash
    bigger = read_identity(write_model(tmp_path / "b.gguf", n_vocab=513)).tokenizer_hash
    _tokens, _scores, types = build_vocab(512)
    types[300] = int(gguf.TokenType.USER_DEFINED)
    retyped = write_model(tmp_path / "c.gguf", extra_kv={"tokenizer.ggml.token_type": types})
    merged = write_model(tmp_path / "d.gguf", extra_kv={"tokenizer.ggml.merges": ["a b"]})
    hashes = {
        base,
        bigger,
        read_identity(retyped).tokenizer_hash,
        read_identity(merged).tokenizer_hash,
    }
    assert len(hashes) == 4


def test_tokenizer_hash_encoding_is_unambiguous(tmp_path: Path) -> None:
    # Same concatenated bytes, different token boundaries.
    a = write_custom(tmp_path / "a.gguf", vocab=(["ab", "c"], [1, 1]))
    b = write_custom(tmp_path / "b.gguf", vocab=(["a", "bc"], [1, 1]))
    assert read_identity(a).tokenizer_hash != read_identity(b).tokenizer_hash


def test_big_endian_file_reads_the_same(tmp_path: Path) -> None:
    kw: dict[str, Any] = {
        "vocab": small_vocab(),
        "merges": ["a b", "ab c"],
        "kv": {"general.name": "Endian Coder", "general.file_type": 15, "general.tags": ["tools"]},
    }
    le = read_identity(write_custom(tmp_path / "m.gguf", **kw))
    be_path = tmp_path / "be" / "m.gguf"
    be_path.parent.mkdir()
    be = read_identity(write_custom(be_path, endianess=gguf.GGUFEndian.BIG, **kw))
    assert be.fields() | {"model_path": ""} == le.fields() | {"model_path": ""}
    assert be.tokenizer_hash == le.tokenizer_hash
    assert le.model_quant == "Q4_K_M"
    assert le.model_capabilities == CAP_CODE | CAP_TOOL_USE


# ---------------------------------------------------------------------------------------------
# Quantisation label


def test_quant_names(tmp_path: Path) -> None:
    assert read_identity(write_model(tmp_path / "a.gguf")).model_quant == "F32"
    q4 = write_model(tmp_path / "b.gguf", file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert read_identity(q4).model_quant == "Q4_K_M"
    f16 = write_model(tmp_path / "c.gguf", file_type=gguf.LlamaFileType.MOSTLY_F16)
    assert read_identity(f16).model_quant == "F16"
    removed = write_model(tmp_path / "d.gguf", extra_kv={"general.file_type": 4})
    assert read_identity(removed).model_quant == "unknown(4)"


def test_quant_from_tensor_types_when_label_missing(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": np.zeros((16, 8), dtype=np.float16),
        "blk.0.attn_q.weight": np.zeros((8, 8), dtype=np.float16),
        "output_norm.weight": np.ones(64, dtype=np.float32),  # 1-D: ignored
    }
    p = write_custom(tmp_path / "a.gguf", tensors=tensors)
    assert read_identity(p).model_quant == "F16"
    assert read_identity(write_custom(tmp_path / "b.gguf", tensors={})).model_quant == "unknown"


# ---------------------------------------------------------------------------------------------
# Capabilities from files


def caps_of(tmp_path: Path, **kw: Any) -> int:
    return read_identity(write_model(tmp_path / "m.gguf", **kw)).model_capabilities


def test_plain_model_has_no_capabilities(tmp_path: Path) -> None:
    assert caps_of(tmp_path) == 0


@pytest.mark.parametrize(("layers", "expected"), [(1, CAP_MTP), (0, 0)])
def test_mtp(tmp_path: Path, layers: int, expected: int) -> None:
    assert caps_of(tmp_path, extra_kv={"llama.nextn_predict_layers": layers}) == expected


def test_mtp_other_arch_key(tmp_path: Path) -> None:
    assert caps_of(tmp_path, extra_kv={"glm4moe.nextn_predict_layers": 1}) == CAP_MTP


@pytest.mark.parametrize(
    "extra",
    [
        {"clip.vision.image_size": 336},
        {"llama.vision.block_count": 24},
        {"clip.has_vision_encoder": True},
        {"general.architecture": "clip"},
    ],
)
def test_vision_keys(tmp_path: Path, extra: dict[str, Any]) -> None:
    assert caps_of(tmp_path, extra_kv=extra) == CAP_VISION


def test_audio_only_projector_is_not_vision(tmp_path: Path) -> None:
    extra = {"general.architecture": "clip", "clip.has_vision_encoder": False}
    assert caps_of(tmp_path, extra_kv=extra) == 0


def test_vision_projector_flag(tmp_path: Path) -> None:
    p = write_model(tmp_path / "m.gguf")
    assert read_identity(p, vision_projector=True).model_capabilities == CAP_VISION


@pytest.mark.parametrize(
    ("tags", "expected"),
    [
        (["Reasoning"], CAP_REASONING),
        (["deep-reasoning-model"], CAP_REASONING),
        (["reason"], 0),
        (["tool-use"], CAP_TOOL_USE),
        (["Function_Calling"], CAP_TOOL_USE),
        (["function-calling"], CAP_TOOL_USE),
        (["TOOLS"], CAP_TOOL_USE),
        (["toolkit"], 0),
        (["codes"], CAP_CODE),
        (["Coder"], CAP_CODE),
        (["code-generation"], 0),  # tags must be exact (spec: "tag in code/coding/...")
        (["text-generation", "coding", "reasoning"], CAP_CODE | CAP_REASONING),
    ],
)
def test_tags(tmp_path: Path, tags: list[str], expected: int) -> None:
    assert caps_of(tmp_path, tags=tags) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("CodeLlama 7B", CAP_CODE),
        ("Qwen2.5-Coder-7B", CAP_CODE),
        ("DeepSeekCoder", CAP_CODE),
        ("Decoder", 0),
        ("Encoder Decoder", 0),
        ("Llama Tool Use 8B", CAP_TOOL_USE),
        ("Hermes-FunctionCalling", CAP_TOOL_USE),
    ],
)
def test_display_name_from_file(tmp_path: Path, name: str, expected: int) -> None:
    assert caps_of(tmp_path, name=name) == expected


def test_base_model_name_also_counts(tmp_path: Path) -> None:
    assert caps_of(tmp_path, name="Acme Chat", base_model_name="CodeLlama-7b") == CAP_CODE


def test_stem_counts_when_no_name(tmp_path: Path) -> None:
    p = write_custom(tmp_path / "deepseek-coder-1.3b.gguf")
    assert read_identity(p).model_capabilities == CAP_CODE
    # A lowercase run is one word: "starcoder" is not "star" + "coder".
    assert read_identity(write_custom(tmp_path / "starcoder2-3b.gguf")).model_capabilities == 0


# ---------------------------------------------------------------------------------------------
# Word splitting (display-name rules)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("CodeLlama", ["Code", "Llama"]),
        ("Qwen2.5-Coder-7B", ["Qwen", "2", "5", "Coder", "7", "B"]),
        ("DeepSeekCoder", ["Deep", "Seek", "Coder"]),
        ("HTMLParser", ["HTML", "Parser"]),
        ("CODELlama", ["CODE", "Llama"]),
        ("my_code_model", ["my", "code", "model"]),
        ("Decoder", ["Decoder"]),
        ("", []),
        ("--__--", []),
        ("通义千问Coder", ["通义千问", "Coder"]),
    ],
)
def test_split_words(text: str, words: list[str]) -> None:
    assert split_words(text) == words


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("CodeLlama", CAP_CODE),
        ("codellama-13b", 0),  # no capital: "codellama" is one word
        ("Qwen2.5-Coder-7B-Instruct", CAP_CODE),
        ("DeepSeekCoder", CAP_CODE),
        ("StarCoder2", CAP_CODE),
        ("my_code_model", CAP_CODE),
        ("CODE", CAP_CODE),
        ("Coding Assistant", CAP_CODE),
        ("Decoder", 0),
        ("Encoder Decoder", 0),
        ("codebook", 0),
        ("Codestral", 0),
        ("Barcode", 0),
        ("Tool", CAP_TOOL_USE),
        ("ToolACE-8B", CAP_TOOL_USE),
        ("llama-tools", CAP_TOOL_USE),
        ("tool_use", CAP_TOOL_USE),
        ("function calling llama", CAP_TOOL_USE),
        ("function_calling", CAP_TOOL_USE),
        ("Functioncalling", CAP_TOOL_USE),
        ("Function Gemma", 0),
        ("Toolformer", 0),
        ("Stool", 0),
        ("Code Tool", CAP_CODE | CAP_TOOL_USE),
    ],
)
def test_display_name_rules(name: str, expected: int) -> None:
    assert capabilities_from_metadata({}, tags=[], display_names=[name]) == expected


@given(st.text())
def test_split_words_property(text: str) -> None:
    words = split_words(text)
    assert all(words)
    # Words partition the letters/digits of the text, in order.
    assert "".join(words) == re.sub(r"[\W_]+", "", text)


@given(
    st.dictionaries(
        st.text(max_size=30),
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text()),
        max_size=5,
    ),
    st.lists(st.text(max_size=20), max_size=4),
    st.lists(st.text(max_size=40), max_size=3),
)
def test_capabilities_never_raise(kv: dict[str, Any], tags: list[str], names: list[str]) -> None:
    caps = capabilities_from_metadata(kv, tags=tags, display_names=names)
    assert 0 <= caps <= 0x1F


def test_capability_names() -> None:
    assert capability_names(0) == []
    assert capability_names(CAP_MTP | CAP_VISION | CAP_CODE) == ["MTP", "VISION", "CODE"]
    assert capability_names(0x40 | CAP_REASONING) == ["REASONING", "BIT6"]


# ---------------------------------------------------------------------------------------------
# The metadata walker agrees with gguf.GGUFReader; bad files fail cleanly


def test_metadata_matches_gguf_reader(tmp_path: Path) -> None:
    extra = {
        "test.flag": True,
        "test.f": 0.5,
        "test.s": "héllo",
        "test.list_s": ["a", "", "ü"],
        "test.list_i": [1, 2, 3],
        "llama.nextn_predict_layers": 1,
    }
    p = write_model(
        tmp_path / "m.gguf",
        tags=["x", "y"],
        base_model_name="B",
        extra_kv=extra | {"tokenizer.ggml.merges": ["a b"]},
    )
    reader = gguf.GGUFReader(p)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        meta = gguf_meta.GgufMeta(mm)
        expected_keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        assert list(meta.scalars) == expected_keys
        for key in expected_keys:
            field = reader.fields[key]
            ours = meta.scalars[key]
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                if field.types[-1] == gguf.GGUFValueType.STRING:
                    assert meta.get_str_list(key) == field.contents(), key
                else:
                    got = (
                        meta.int_array(ours).tolist()
                        if ours.elem_type in gguf_meta._INT_TYPES
                        else None
                    )
                    if got is not None:
                        assert got == field.contents(), key
                    assert ours.count == len(field.data), key
            else:
                assert ours == pytest.approx(field.contents()), key
        tensor_types = [(int(t.tensor_type), len(t.shape), t.n_elements) for t in reader.tensors]
        assert meta.tensor_types() == tensor_types


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all, sorry" * 4)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_identity(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError):
        read_identity(empty)
    with pytest.raises(FileNotFoundError):
        read_identity(tmp_path / "missing.gguf")


@pytest.mark.parametrize("cut", [30, 200, 2000, 6000])
def test_truncated_metadata(tmp_path: Path, cut: int) -> None:
    full = write_model(tmp_path / "m.gguf").read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(full[:cut])
    with pytest.raises(ValueError):
        read_identity(short)


# ---------------------------------------------------------------------------------------------
# compare_identity (spec §4.2)


def test_exact_match_accepted() -> None:
    r = resident()
    m = compare_identity(r, kv_of(r, model_alias="qwen-7b"), header_model="qwen-7b")
    assert m.accepted and m.reason == ""
    assert m.as_meta() == {
        "tokenizer_match": True,
        "tokenizer_hash_match": None,
        "model_hash_match": None,
        "model_name_match": True,
        "model_quant_match": True,
        "model_capabilities_match": True,
        "model_alias_match": True,
        "capabilities_xor": 0,
        "capabilities_diff_bits": [],
    }


def test_real_file_identity_matches_itself(tmp_path: Path) -> None:
    r = read_identity(write_model(tmp_path / "m.gguf", extra_kv={"llama.nextn_predict_layers": 1}))
    kv = kv_of(r, tokenizer_hash=r.tokenizer_hash)
    m = compare_identity(r, kv, header_model=None)
    assert m.accepted and m.tokenizer_hash_match is True
    assert m.model_alias_match is False  # nothing named the alias; reported only


HASH = "ab" * 32


def test_model_hash_is_checked_when_the_kv_side_sends_one() -> None:
    """model_hash (SHA-256 of the GGUF file) names one file exactly: a DECODE whose
    kv_metadata carries another is refused; one without it is not checked (mixed
    quantisation stays allowed), and neither is one where no hash is known here."""
    r = resident(model_hash=HASH)
    assert r.fields()["model_hash"] == HASH
    same = compare_identity(r, kv_of(r), header_model=None)
    assert same.accepted and same.model_hash_match is True
    assert compare_identity(r, kv_of(r, model_hash=HASH.upper()), header_model=None).model_hash_match is True
    for bad in ("cd" * 32, "", 7, ["x"]):
        m = compare_identity(r, kv_of(r, model_hash=bad), header_model=None)
        assert not m.accepted and m.model_hash_match is False, bad
        assert m.reason.startswith("model_hash mismatch: kv ") and HASH in m.reason
        assert m.as_meta()["model_hash_match"] is False
    unsent = compare_identity(r, {k: v for k, v in kv_of(r).items() if k != "model_hash"}, header_model=None)
    assert unsent.accepted and unsent.model_hash_match is None
    assert compare_identity(r, kv_of(r, model_hash=None), header_model=None).model_hash_match is None
    unknown = resident()  # no hash computed: nothing to hold it against
    assert "model_hash" not in unknown.fields()
    assert compare_identity(unknown, kv_of(r, model_hash="cd" * 32), header_model=None).accepted


def test_file_sha256_is_the_files_digest(tmp_path: Path) -> None:
    import hashlib

    path = write_model(tmp_path / "m.gguf")
    data = path.read_bytes()
    calls: list[int] = []
    got = file_sha256(path, between_chunks=lambda: calls.append(1))
    assert got == hashlib.sha256(data).hexdigest() and re.fullmatch(r"[0-9a-f]{64}", got)
    assert len(calls) == -(-len(data) // (8 << 20))  # one check per 8 MiB chunk
    other = write_model(tmp_path / "o.gguf", seed=1)
    assert file_sha256(other) != got  # same shape, other weights


def test_quant_difference_accepted_and_reported() -> None:
    r = resident()
    m = compare_identity(r, kv_of(r, model_quant="Q8_0"), header_model=None)
    assert m.accepted and m.reason == ""
    assert m.model_quant_match is False


@pytest.mark.parametrize("bit", [CAP_REASONING, CAP_CODE, CAP_TOOL_USE])
def test_soft_capability_difference_accepted(bit: int) -> None:
    r = resident()
    m = compare_identity(
        r, kv_of(r, model_capabilities=r.model_capabilities ^ bit), header_model=None
    )
    assert m.accepted and m.reason == ""
    assert m.model_capabilities_match is False
    assert m.capabilities_xor == bit
    assert m.capabilities_diff_bits == (ident.CAPABILITY_NAMES[bit],)


@pytest.mark.parametrize(("bit", "name"), [(CAP_MTP, "MTP"), (CAP_VISION, "VISION")])
def test_hard_capability_difference_rejected(bit: int, name: str) -> None:
    r = resident()
    m = compare_identity(
        r, kv_of(r, model_capabilities=r.model_capabilities | bit | CAP_CODE), header_model=None
    )
    assert not m.accepted
    assert m.capabilities_diff_bits == (name, "CODE")
    assert name in m.reason and "CODE" not in m.reason
    # Resident has it, KV does not: rejected too.
    r2 = resident(model_capabilities=bit)
    assert not compare_identity(r2, kv_of(r2, model_capabilities=0), header_model=None).accepted


def test_tokenizer_mismatch_rejected() -> None:
    r = resident()
    m = compare_identity(r, kv_of(r, tokenizer="llama/llama-bpe"), header_model="qwen-7b")
    assert not m.accepted and not m.tokenizer_match
    assert "tokenizer" in m.reason and "llama/llama-bpe" in m.reason


def test_tokenizer_hash_mismatch_rejected() -> None:
    r = resident()
    m = compare_identity(r, kv_of(r, tokenizer_hash="xxh3:ffffffffffffffff"), header_model=None)
    assert not m.accepted
    assert m.tokenizer_match and m.tokenizer_hash_match is False
    assert "tokenizer_hash" in m.reason
    nulled = compare_identity(r, kv_of(r, tokenizer_hash=None), header_model=None)
    assert nulled.accepted and nulled.tokenizer_hash_match is None


def test_name_mismatch_rejected_unless_alias_matches() -> None:
    r = resident()
    kv = kv_of(r, model_name="Llama 3 8B")
    m = compare_identity(r, kv, header_model="other")
    assert not m.accepted and not m.model_name_match and not m.model_alias_match
    assert "model_name" in m.reason and "Llama 3 8B" in m.reason
    by_kv_alias = compare_identity(r, kv | {"model_alias": "qwen-7b"}, header_model=None)
    assert by_kv_alias.accepted and by_kv_alias.model_name_match and by_kv_alias.model_alias_match
    by_header = compare_identity(r, kv, header_model="qwen-7b")
    assert by_header.accepted and by_header.model_name_match and by_header.model_alias_match


def test_every_failing_check_is_named() -> None:
    r = resident()
    kv = {"tokenizer": "spm", "model_name": "X", "model_capabilities": CAP_VISION}
    m = compare_identity(r, kv, header_model=None)
    assert not m.accepted
    for word in ("tokenizer", "model_name", "VISION"):
        assert word in m.reason


@pytest.mark.parametrize(
    "kv",
    [
        {},
        {"tokenizer": None, "model_name": None, "model_capabilities": None},
        {"tokenizer": 5, "model_name": ["x"], "model_capabilities": "3", "model_quant": 4},
        {"tokenizer": "gpt2/qwen2", "model_name": "Qwen2.5 7B Instruct", "model_capabilities": "8"},
        {"model_alias": {"x": 1}, "tokenizer_hash": 7, "model_capabilities": 2**40},
        {"model_capabilities": -1, "model_capabilities_x": True, 3: "int key"},
        None,
        ["not", "a", "dict"],
    ],
)
def test_garbage_kv_meta_rejected_cleanly(kv: Any) -> None:
    r = resident(model_capabilities=CAP_MTP)
    m = compare_identity(r, kv, header_model=None)
    assert isinstance(m, IdentityMatch)
    assert not m.accepted and m.reason
    meta = m.as_meta()
    assert all(isinstance(meta[k], bool) for k in meta if k.endswith("_match") and "hash" not in k)


def test_missing_fields_named_in_reason() -> None:
    m = compare_identity(resident(), {}, header_model=None)
    assert "kv_metadata.tokenizer missing" in m.reason
    assert "kv_metadata.model_name missing" in m.reason
    r = resident(model_capabilities=CAP_MTP)
    m2 = compare_identity(r, kv_of(r, model_capabilities="1"), header_model=None)
    assert not m2.accepted and "model_capabilities invalid" in m2.reason
    m3 = compare_identity(r, kv_of(r, model_capabilities=True), header_model=None)
    assert not m3.accepted  # a JSON true is not the integer 1


KV_KEYS = [
    "tokenizer",
    "model_name",
    "model_quant",
    "model_capabilities",
    "model_alias",
    "tokenizer_hash",
]


@given(
    st.dictionaries(
        st.one_of(
            st.sampled_from(KV_KEYS),
            st.text(max_size=5),
        ),
        st.recursive(
            st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
            max_leaves=5,
        ),
        max_size=7,
    ),
    st.one_of(st.none(), st.text(max_size=10)),
)
def test_compare_never_raises(kv: dict[str, Any], header_model: str | None) -> None:
    m = compare_identity(resident(), kv, header_model=header_model)
    assert m.accepted == (m.reason == "")
    assert 0 <= m.capabilities_xor <= 0xFFFFFFFF
