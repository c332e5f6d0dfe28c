"""Write real GGUF files (llama, mamba for a recurrent model, qwen3 for a reranker) with random
weights (tests, demos, benchmarks): generative models, an embedding model (a pooling type),
a reranker (a rank head) and a code model (fill-in-the-middle tokens).

No model can be downloaded where this project is built and tested, so it writes its own:
llama.cpp loads them like any other GGUF, and greedy output is deterministic for a seed.
"""

from __future__ import annotations

import logging
import os
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

log = logging.getLogger(__name__)

# Bump when the bytes a preset produces change, so cached demo models are rewritten.
SYNTHETIC_FORMAT_VERSION = 1

CHATML_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# Words whose every "▁"-prefix becomes a piece, so SPM merges can reach the whole word.
_WORDS = (
    "the of and to in is that it for you was on are with as be at this have from or one had by "
    "not but what all were when we there can an your which their said if do will each about how "
    "up out them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find use may "
    "water long little very after words called just where most know get through back much before "
    "go good new write our used me man too any day same right look think also around another came "
    "come work three word must because does part even place well such here take why things help "
    "put years different away again off went old number great tell men say small every found still "
    "between name should home big give air line set own under read last never us left end along "
    "while might next sound below saw something thought both few those always looked show large "
    "often together asked house don world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head above "
    "kind began almost live page got earth need far hand high year mother light parts country "
    "father let night following picture being study second eyes soon times story boys since white "
    "days paper hard near sentence better best across during today others however sure means "
    "knew whether hello world model token engine decode prefill slot cache server client stream "
    "request response assistant user system tool function code reasoning"
).split()


@dataclass(frozen=True, slots=True)
class Preset:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    file_type: gguf.LlamaFileType
    name: str
    # "llama", or "mamba": a recurrent model (one state per sequence, no per-position KV;
    # n_head, n_head_kv and n_ff unused), for what only such a memory does (checkpoints);
    # "lfm2": a hybrid (short-convolution layers with a recurrent state, every other layer
    # attention with a KV cache), for what a memory of both holds;
    # "qwen3": llama's blocks with q/k norms, the architecture llama.cpp gives a rank head;
    # "bert": an encoder (bidirectional attention, no KV cache, no LM head), WordPiece vocabulary.
    arch: str = "llama"
    # The model's own pooling (``{arch}.pooling_type``): "mean", "cls", "last" make an
    # embedding model; "rank" a reranker (qwen3 only: Qwen3-Reranker's layout, see _RANK).
    pooling: str | None = None
    fim: bool = False  # fill-in-the-middle tokens (Qwen2.5-Coder's), for /infill


PRESETS: dict[str, Preset] = {
    # ≈0.5 MB: unit tests, loads in milliseconds.
    "tiny": Preset(512, 64, 2, 4, 2, 192, 4096, gguf.LlamaFileType.ALL_F32, "Hydra Synthetic Tiny"),
    # ≈33 M params: integration tests and the demo model.
    "small": Preset(8192, 512, 8, 8, 4, 1376, 8192, gguf.LlamaFileType.MOSTLY_F16, "Hydra Synthetic Small"),
    # ≈134 M params, 768 wide, 12 layers: compute and KV size of a real model of that shape.
    "bench": Preset(32000, 768, 12, 12, 12, 2048, 8192, gguf.LlamaFileType.MOSTLY_F16, "Hydra Synthetic Bench"),
    # ≈0.5 MB: llama.cpp's mamba architecture (llama_model_is_recurrent), loads in milliseconds.
    "mamba": Preset(512, 64, 2, 0, 0, 0, 4096, gguf.LlamaFileType.ALL_F32, "Hydra Synthetic Mamba", "mamba"),
    # ≈1.1 MB: llama.cpp's lfm2 architecture (llama_model_is_hybrid): conv, attention, conv, attention.
    "hybrid": Preset(512, 64, 4, 4, 2, 192, 4096, gguf.LlamaFileType.ALL_F32, "Hydra Synthetic Hybrid", "lfm2"),
    # ≈0.5 MB each, tiny's shape: an embedding model (mean pooling, as gte-Qwen's GGUFs declare
    # theirs), a reranker (Qwen3-Reranker's rank head) and a code model with FIM tokens.
    "embed": Preset(512, 64, 2, 4, 2, 192, 4096, gguf.LlamaFileType.ALL_F32, "Hydra Synthetic Embed", pooling="mean"),
    "rerank": Preset(512, 64, 2, 4, 2, 192, 4096, gguf.LlamaFileType.ALL_F32, "Hydra Synthetic Rerank", "qwen3",
                     pooling="rank"),
    "fim": Preset(512, 64, 2, 4, 2, 192, 4096, gguf.LlamaFileType.ALL_F32, "Hydra Synthetic FIM", fim=True),
    # ≈0.3 MB: an encoder as most embedding GGUFs are (bge, MiniLM, nomic): BERT, mean pooling.
    "bert": Preset(512, 64, 2, 4, 4, 128, 512, gguf.LlamaFileType.ALL_F32, "Hydra Synthetic BERT", "bert",
                   pooling="mean"),
}

POOLING_TYPES = {"none": gguf.PoolingType.NONE, "mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS,
                 "last": gguf.PoolingType.LAST, "rank": gguf.PoolingType.RANK}
# Qwen3-Reranker as llama.cpp's converter writes it (conversion/qwen.py): a rank pooling, the
# labels "yes" and "no" (two scores, softmaxed; the score is the first), ``cls.output.weight``
# in place of the LM head, and a "rerank" template that frames a query and a document.
_RANK_LABELS = ["yes", "no"]
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query.<|im_end|>\n"
    "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"
)
# Qwen2.5-Coder's FIM tokens and the GGUF keys that name them, at the top of the vocabulary.
FIM_TOKENS = {
    "fim_pre": "<|fim_prefix|>", "fim_suf": "<|fim_suffix|>", "fim_mid": "<|fim_middle|>",
    "fim_pad": "<|fim_pad|>", "fim_rep": "<|repo_name|>", "fim_sep": "<|file_sep|>",
}


def build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style vocabulary: control tokens, 256 byte tokens, then scored word pieces."""
    tokens: list[str] = list(SPECIAL_TOKENS)
    types = [gguf.TokenType.UNKNOWN, *([gguf.TokenType.CONTROL] * (len(SPECIAL_TOKENS) - 1))]
    scores = [0.0] * len(SPECIAL_TOKENS)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    seen = set(tokens)
    pieces: list[str] = []

    def add(piece: str) -> None:
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)

    # Single characters first, so any ASCII text merges from known symbols.
    add("▁")
    for ch in string.ascii_letters + string.digits + string.punctuation:
        add(ch)
    for word in _WORDS:
        w = "▁" + word
        for i in range(2, len(w) + 1):
            add(w[:i])
    # Fill the rest deterministically with two- and three-letter pieces.
    letters = string.ascii_lowercase
    for a in letters:
        for b in letters:
            add(a + b)
            add("▁" + a + b)
    for a in letters:
        for b in letters:
            for c in letters:
                add(a + b + c)
                add("▁" + a + b + c)
    room = n_vocab - len(tokens)
    if room < 0:
        raise ValueError(f"n_vocab {n_vocab} is below the {len(tokens)} fixed tokens")
    pieces = pieces[:room]
    k = 0
    while len(pieces) < room:  # very large vocabularies: numbered filler pieces
        add(f"▁tok{k}")
        k += 1
    for piece in pieces:
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        # SPM merges the highest-scoring bigram first: prefer longer pieces.
        scores.append(float(len(piece)) - 100.0)
    return tokens, scores, [int(t) for t in types]


def _tensor(rng: np.random.Generator, shape: tuple[int, ...], dtype: type, std: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype)


def write_model(
    path: str | os.PathLike[str],
    preset: str = "tiny",
    *,
    seed: int = 0,
    name: str | None = None,
    base_model_name: str | None = None,
    tags: Sequence[str] = (),
    file_type: gguf.LlamaFileType | None = None,
    tokenizer_pre: str | None = None,
    extra_kv: Mapping[str, Any] | None = None,
    chat_template: str | Sequence[Mapping[str, str]] | None = CHATML_TEMPLATE,
    n_vocab: int | None = None,
    control_tokens: Mapping[int, str] | None = None,
    pooling: str | None = None,
) -> Path:
    """Write a GGUF of the preset's architecture with random weights and return its path.

    ``file_type`` only changes the declared ``general.file_type`` label when it is not one of
    F32/F16 (identity tests need e.g. a "Q4_K_M" label; the weights stay float).
    ``extra_kv`` adds metadata keys verbatim (ints become u32, bools, floats f32, strings,
    lists of strings), e.g. ``{"llama.nextn_predict_layers": 1}``.
    ``chat_template``: Jinja text, or named templates as HF's dict-valued chat_template and
    convert_hf_to_gguf.py write them (``[{"name": "default", "template": ...}, {"name":
    "tool_use", ...}]``: ``tokenizer.chat_template``, ``tokenizer.chat_template.tool_use`` and
    the ``tokenizer.chat_templates`` list). ``control_tokens``: vocabulary ids respelled as
    control tokens (``{id: "<tool_call>"}``, a model's own special tokens; the weights stay
    those of the seed). ``pooling``: the model's own pooling type instead of the preset's
    (a benchmark's embedding model of another preset's size).
    """
    spec = PRESETS[preset]
    if n_vocab is not None:
        spec = replace(spec, n_vocab=n_vocab)
    if pooling is not None:
        spec = replace(spec, pooling=pooling)
    if spec.arch == "bert":
        return _write_bert(Path(path), spec, seed=seed, name=name)
    if spec.pooling == "rank" and spec.arch != "qwen3":
        raise ValueError("a rank head needs the qwen3 architecture (llama.cpp loads cls.output there)")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    arch = spec.arch
    weight_dtype = np.float16 if spec.file_type == gguf.LlamaFileType.MOSTLY_F16 else np.float32
    raw_type = gguf.GGMLQuantizationType.F16 if weight_dtype is np.float16 else gguf.GGMLQuantizationType.F32

    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(name or spec.name)
    if base_model_name:
        writer.add_uint32("general.base_model.count", 1)
        writer.add_string("general.base_model.0.name", base_model_name)
    if tags:
        writer.add_array("general.tags", list(tags))
    writer.add_file_type(int(file_type if file_type is not None else spec.file_type))
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    if arch == "mamba":
        ssm = _mamba_shape(spec.n_embd)
        writer.add_ssm_conv_kernel(ssm.d_conv)
        writer.add_ssm_inner_size(ssm.d_inner)
        writer.add_ssm_state_size(ssm.d_state)
        writer.add_ssm_time_step_rank(ssm.dt_rank)
    else:
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        if arch == "lfm2":  # no KV heads: a short-convolution layer (its recurrent state)
            writer.add_head_count_kv([0 if _is_conv(i) else spec.n_head_kv for i in range(spec.n_layer)])
            writer.add_shortconv_l_cache(_LFM2_L_CACHE)
        else:
            writer.add_head_count_kv(spec.n_head_kv)
        writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
        writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(spec.n_vocab)

    tokens, scores, types = build_vocab(spec.n_vocab)
    control = dict(control_tokens or {})
    if spec.fim:  # the vocabulary's last ids, named by their keys
        for i, (key, text) in enumerate(FIM_TOKENS.items()):
            control[spec.n_vocab - len(FIM_TOKENS) + i] = text
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", spec.n_vocab - len(FIM_TOKENS) + i)
    if spec.pooling is not None:
        writer.add_pooling_type(POOLING_TYPES[spec.pooling])
    if spec.pooling == "rank":
        writer.add_classifier_output_labels(_RANK_LABELS)
        if isinstance(chat_template, str):
            chat_template = [
                {"name": "default", "template": chat_template},
                {"name": "rerank", "template": RERANK_TEMPLATE},
            ]
    for token_id, text in control.items():
        if not len(SPECIAL_TOKENS) + 256 <= token_id < spec.n_vocab:
            raise ValueError(f"control token id {token_id} is not a word piece of the vocabulary")
        tokens[token_id], types[token_id], scores[token_id] = text, int(gguf.TokenType.CONTROL), 0.0
    writer.add_tokenizer_model("llama")
    if tokenizer_pre:
        writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(IM_END_ID)  # the chat turn terminator ends generation
    writer.add_unk_token_id(UNK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    for key, value in (extra_kv or {}).items():
        _add_kv(writer, key, value)

    rng = np.random.default_rng(seed)
    d, ff, v = spec.n_embd, spec.n_ff, spec.n_vocab
    d_kv = d // max(spec.n_head, 1) * spec.n_head_kv
    std = 0.02
    # numpy shapes are (rows, cols) = ggml's (ne1, ne0): output features first.
    writer.add_tensor("token_embd.weight", _tensor(rng, (v, d), weight_dtype, 1.0), raw_dtype=raw_type)
    for i in range(spec.n_layer if arch in ("llama", "qwen3") else 0):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(d, dtype=np.float32))
        if arch == "qwen3":
            writer.add_tensor(p + "attn_q_norm.weight", np.ones(d // spec.n_head, dtype=np.float32))
            writer.add_tensor(p + "attn_k_norm.weight", np.ones(d // spec.n_head, dtype=np.float32))
        writer.add_tensor(p + "attn_q.weight", _tensor(rng, (d, d), weight_dtype, std), raw_dtype=raw_type)
        writer.add_tensor(p + "attn_k.weight", _tensor(rng, (d_kv, d), weight_dtype, std), raw_dtype=raw_type)
        writer.add_tensor(p + "attn_v.weight", _tensor(rng, (d_kv, d), weight_dtype, std), raw_dtype=raw_type)
        writer.add_tensor(p + "attn_output.weight", _tensor(rng, (d, d), weight_dtype, std), raw_dtype=raw_type)
        writer.add_tensor(p + "ffn_norm.weight", np.ones(d, dtype=np.float32))
        writer.add_tensor(p + "ffn_gate.weight", _tensor(rng, (ff, d), weight_dtype, std), raw_dtype=raw_type)
        writer.add_tensor(p + "ffn_up.weight", _tensor(rng, (ff, d), weight_dtype, std), raw_dtype=raw_type)
        writer.add_tensor(p + "ffn_down.weight", _tensor(rng, (d, ff), weight_dtype, std), raw_dtype=raw_type)
    if arch == "mamba":
        _add_mamba_layers(writer, rng, spec)
    if arch == "lfm2":
        _add_lfm2_layers(writer, rng, spec)
        # llama.cpp's name for LFM2's output norm
        writer.add_tensor("token_embd_norm.weight", np.ones(d, dtype=np.float32))
    else:
        writer.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    # A larger output scale gives peaked, varied logits instead of near-uniform noise.
    head = _tensor(rng, (v, d), weight_dtype, 0.5)
    if spec.pooling == "rank":
        # In place of the LM head (the model ties its output to token_embd, as Qwen3-Reranker's
        # GGUF does): two rows, small enough that the softmaxed scores spread over (0, 1).
        writer.add_tensor(
            "cls.output.weight", _tensor(rng, (len(_RANK_LABELS), d), weight_dtype, 0.05), raw_dtype=raw_type
        )
    else:
        writer.add_tensor("output.weight", head, raw_dtype=raw_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)  # atomic: a concurrent reader never sees a half-written model
    return out


@dataclass(frozen=True, slots=True)
class _MambaShape:
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int


def _mamba_shape(n_embd: int) -> _MambaShape:
    # Mamba-1's own ratios (llama.cpp takes an expansion factor of 2 only).
    return _MambaShape(d_inner=2 * n_embd, d_state=16, d_conv=4, dt_rank=-(-n_embd // 16))


def _add_mamba_layers(writer: gguf.GGUFWriter, rng: np.random.Generator, spec: Preset) -> None:
    """Mamba-1 blocks as llama.cpp's mamba architecture loads them (src/models/mamba.cpp),
    all f32. The selective scan's A is negative (-exp of a log, Mamba's init) so the state
    decays, and slowly (dt's bias -4: softplus ≈ 0.018 a step), with weights strong enough
    that the next token depends on tokens far back: a wrong state shows in the logits."""
    d, s = spec.n_embd, _mamba_shape(spec.n_embd)
    f32 = np.float32
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(d, dtype=f32))
        writer.add_tensor(p + "ssm_in.weight", _tensor(rng, (2 * s.d_inner, d), f32, 0.3))
        writer.add_tensor(p + "ssm_conv1d.weight", _tensor(rng, (s.d_inner, s.d_conv), f32, 0.3))
        writer.add_tensor(p + "ssm_conv1d.bias", np.zeros(s.d_inner, dtype=f32))
        writer.add_tensor(p + "ssm_x.weight", _tensor(rng, (s.dt_rank + 2 * s.d_state, s.d_inner), f32, 0.3))
        writer.add_tensor(p + "ssm_dt.weight", _tensor(rng, (s.d_inner, s.dt_rank), f32, 0.3))
        writer.add_tensor(p + "ssm_dt.bias", np.full(s.d_inner, -4.0, dtype=f32))
        a_log = np.log(np.tile(np.arange(1, s.d_state + 1, dtype=f32), (s.d_inner, 1)))
        writer.add_tensor(p + "ssm_a", -np.exp(a_log))
        writer.add_tensor(p + "ssm_d", np.ones(s.d_inner, dtype=f32))
        writer.add_tensor(p + "ssm_out.weight", _tensor(rng, (d, s.d_inner), f32, 0.3))


BERT_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def build_wordpiece_vocab(n_vocab: int) -> list[str]:
    """A WordPiece vocabulary as llama.cpp's "bert" tokenizer reads it (convert_hf_to_gguf
    writes a word's first piece with "▁" and a continuation without BERT's "##"): the special
    tokens, each character as a word start and as a continuation, whole words, then
    two-letter continuations."""
    tokens = list(BERT_SPECIAL)
    seen = set(tokens)

    def add(piece: str) -> None:
        if piece not in seen and len(tokens) < n_vocab:
            seen.add(piece)
            tokens.append(piece)

    for ch in string.ascii_lowercase + string.digits + string.punctuation:
        add("▁" + ch)
        add(ch)
    for word in _WORDS:
        add("▁" + word)
    for a in string.ascii_lowercase:
        for b in string.ascii_lowercase:
            add(a + b)
    if len(tokens) < n_vocab:
        raise ValueError(f"n_vocab {n_vocab} is more than this WordPiece vocabulary's {len(tokens)} pieces")
    return tokens


def _write_bert(out: Path, spec: Preset, *, seed: int, name: str | None) -> Path:
    """A BERT encoder as llama.cpp's bert architecture loads it (src/models/bert.cpp): token,
    token-type and position embeddings, post-norm blocks with biases; [CLS] and [SEP] around
    a text (the tokenizer adds them), bidirectional attention, the preset's pooling."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "bert")
    w.add_name(name or spec.name)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_block_count(spec.n_layer)
    w.add_head_count(spec.n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(POOLING_TYPES[spec.pooling or "mean"])
    tokens = build_wordpiece_vocab(spec.n_vocab)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(
        [int(gguf.TokenType.CONTROL)] * len(BERT_SPECIAL)
        + [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(BERT_SPECIAL))
    )
    w.add_uint32(gguf.Keys.Tokenizer.TOKEN_TYPE_COUNT, 2)
    pad, unk, cls, sep, _mask = range(len(BERT_SPECIAL))
    w.add_bos_token_id(cls)  # llama.cpp's bert tokenizer adds BOS and EOS: [CLS] text [SEP]
    w.add_eos_token_id(sep)
    w.add_sep_token_id(sep)
    w.add_pad_token_id(pad)
    w.add_unk_token_id(unk)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    rng = np.random.default_rng(seed)
    d, ff = spec.n_embd, spec.n_ff

    def f32(*shape: int, std: float = 0.1) -> np.ndarray:
        return _tensor(rng, shape, np.float32, std)

    def norm(prefix: str, n: int) -> None:
        w.add_tensor(prefix + ".weight", np.ones(n, dtype=np.float32))
        w.add_tensor(prefix + ".bias", np.zeros(n, dtype=np.float32))

    w.add_tensor("token_embd.weight", f32(len(tokens), d))
    w.add_tensor("token_types.weight", f32(2, d))
    w.add_tensor("position_embd.weight", f32(spec.n_ctx_train, d))
    norm("token_embd_norm", d)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + t + ".weight", f32(d, d))
            w.add_tensor(p + t + ".bias", np.zeros(d, dtype=np.float32))
        norm(p + "attn_output_norm", d)
        w.add_tensor(p + "ffn_up.weight", f32(ff, d))
        w.add_tensor(p + "ffn_up.bias", np.zeros(ff, dtype=np.float32))
        w.add_tensor(p + "ffn_down.weight", f32(d, ff))
        w.add_tensor(p + "ffn_down.bias", np.zeros(d, dtype=np.float32))
        norm(p + "layer_output_norm", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


_LFM2_L_CACHE = 3  # the short convolution's width: its recurrent state holds the last 2 positions


def _is_conv(layer: int) -> bool:
    return layer % 2 == 0


def _add_lfm2_layers(writer: gguf.GGUFWriter, rng: np.random.Generator, spec: Preset) -> None:
    """LFM2 blocks as llama.cpp's lfm2 architecture loads them (src/models/lfm2.cpp), all f32:
    even layers a gated short convolution, odd ones attention with Q/K norms; a SwiGLU FFN
    after each. Weights strong enough that the next token depends on earlier ones."""
    d, ff, f32 = spec.n_embd, spec.n_ff, np.float32
    head = d // spec.n_head
    d_kv = head * spec.n_head_kv
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(d, dtype=f32))
        if _is_conv(i):
            writer.add_tensor(p + "shortconv.conv.weight", _tensor(rng, (d, _LFM2_L_CACHE), f32, 0.5))
            writer.add_tensor(p + "shortconv.in_proj.weight", _tensor(rng, (3 * d, d), f32, 0.3))
            writer.add_tensor(p + "shortconv.out_proj.weight", _tensor(rng, (d, d), f32, 0.3))
        else:
            writer.add_tensor(p + "attn_q_norm.weight", np.ones(head, dtype=f32))
            writer.add_tensor(p + "attn_k_norm.weight", np.ones(head, dtype=f32))
            writer.add_tensor(p + "attn_q.weight", _tensor(rng, (d, d), f32, 0.2))
            writer.add_tensor(p + "attn_k.weight", _tensor(rng, (d_kv, d), f32, 0.2))
            writer.add_tensor(p + "attn_v.weight", _tensor(rng, (d_kv, d), f32, 0.2))
            writer.add_tensor(p + "attn_output.weight", _tensor(rng, (d, d), f32, 0.2))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(d, dtype=f32))
        writer.add_tensor(p + "ffn_gate.weight", _tensor(rng, (ff, d), f32, 0.1))
        writer.add_tensor(p + "ffn_up.weight", _tensor(rng, (ff, d), f32, 0.1))
        writer.add_tensor(p + "ffn_down.weight", _tensor(rng, (d, ff), f32, 0.1))


def _add_kv(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list | tuple):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"unsupported metadata value for {key!r}: {type(value).__name__}")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hydra-trio" / "models"


def cached_model(preset: str = "small", *, seed: int = 0) -> tuple[Path, bool]:
    """Path of the synthetic model in the user cache, writing it first if missing.

    Returns (path, written_now).
    """
    path = cache_dir() / f"hydra-synthetic-{preset}-s{seed}-v{SYNTHETIC_FORMAT_VERSION}.gguf"
    if path.exists():
        return path, False
    log.info("writing synthetic %s model to %s (first run only)", preset, path)
    write_model(path, preset, seed=seed)
    return path, True
