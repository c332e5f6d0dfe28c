"""What a loaded llama model says of itself (``ModelInfo``): its sizes, special tokens and their
text, chat templates, token roles and pooling, read through llama.cpp once at load.

Kept apart from the context (context.py) because it changes with what the engine asks of a
model, not with how the model and its context live. Worker only, like every llama call.
"""

from __future__ import annotations

import llama_cpp

from .chat import gguf_template_variants
from .embedding import model_pooling
from .types import TOKEN_ROLES, ModelInfo, TokenRoles


def read_model_info(model: llama_cpp.llama_model_p, vocab: llama_cpp.llama_vocab_p) -> ModelInfo:
    """The model's ``ModelInfo``, from the model and its vocabulary (llama_model_get_vocab)."""
    m, v = model, vocab
    tpl_ptr = llama_cpp.llama_model_chat_template(m, None)
    template = tpl_ptr.decode("utf-8", "replace") if tpl_ptr else None
    bos, eos = llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v)
    rerank = llama_cpp.llama_model_chat_template(m, b"rerank")
    return ModelInfo(
        n_vocab=llama_cpp.llama_vocab_n_tokens(v),
        n_ctx_train=llama_cpp.llama_model_n_ctx_train(m),
        n_embd=llama_cpp.llama_model_n_embd(m),
        n_layer=llama_cpp.llama_model_n_layer(m),
        bos=bos,
        eos=eos,
        add_bos=bool(llama_cpp.llama_vocab_get_add_bos(v)),
        chat_template=template,
        recurrent=bool(llama_cpp.llama_model_is_recurrent(m)),
        hybrid=bool(llama_cpp.llama_model_is_hybrid(m)),
        bos_text=vocab_text(v, bos),
        eos_text=vocab_text(v, eos),
        chat_template_variants=gguf_template_variants(model),
        roles=TokenRoles({r: t for r in TOKEN_ROLES if (t := getattr(llama_cpp, f"llama_vocab_{r}")(v)) >= 0},
                         add_bos=bool(llama_cpp.llama_vocab_get_add_bos(v)),
                         add_eos=bool(llama_cpp.llama_vocab_get_add_eos(v)),
                         add_sep=bool(llama_cpp.llama_vocab_get_add_sep(v))),
        pooling=model_pooling(m),
        rerank_template=(rerank or b"").decode("utf-8", "replace") or None,
    )


def vocab_text(vocab: llama_cpp.llama_vocab_p, token: int) -> str:
    """A token's text as the vocabulary stores it ("" for none: a negative id)."""
    if token < 0:
        return ""
    return llama_cpp.llama_vocab_get_text(vocab, token).decode("utf-8", "replace")
