"""HF tokenizer -> GGUF `tokenizer.ggml.*`, refusing what llama.cpp would tokenize differently.

Two tokenizer models are expressible:
  gpt2   byte-level BPE (tokenizer.json with a ByteLevel pre-tokenizer): tokens, merges and
         `tokenizer.ggml.pre`, the name of llama.cpp's pre-tokenizer regex. The pre-tokenizer
         is identified the way llama.cpp's converter does it: token ids of a fixed probe text
         are hashed and looked up in a table of known tokenizers; failing that, the HF
         pre-tokenizer's split regex is compared with the regexes llama.cpp implements.
         No match is an error (a wrong or missing `pre` silently degrades llama.cpp's
         tokenization).
  llama  SentencePiece-style BPE with byte fallback (tokenizer.json with a Metaspace
         pre-tokenizer or a "▁" normalizer), read with gguf's LlamaHfVocab (scores + types).
add_bos / add_eos come from what the HF tokenizer actually does when encoding.
"""

from __future__ import annotations

import contextlib
import gc
import json
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

from quantkit.errors import UnsupportedArchitecture

__all__ = ["TokenizerExport", "read_tokenizer", "UnsupportedTokenizer", "KNOWN_PRE", "bpe_merges"]


class UnsupportedTokenizer(UnsupportedArchitecture):
    """The tokenizer cannot be written as GGUF metadata that llama.cpp reproduces."""


# llama.cpp's pre-tokenizer probe text (convert_hf_to_gguf_update.py); hashes of its token ids
# identify the pre-tokenizer. Only tokenizers of the families quantkit converts are listed.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not "
    "sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
KNOWN_PRE = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM/2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",
}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# When the probe hash is unknown (a known pre-tokenizer over another vocabulary), the HF
# pre-tokenizer itself is compared with the ones llama.cpp implements (src/llama-vocab.cpp):
# the same split regex means the same pre-tokenization, whatever the vocabulary.
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_RE = _QWEN2_RE.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_STRUCTURAL = {
    "qwen2": (("Split", _QWEN2_RE), ("ByteLevel", False)),
    "llama-bpe": (("Split", _LLAMA3_RE), ("ByteLevel", False)),
    "smollm": (("Digits", True), ("ByteLevel", True)),
    "gpt-2": (("ByteLevel", True),),
}


@dataclass
class TokenizerExport:
    model: str  # "gpt2" | "llama"
    pre: str
    tokens: list[str | bytes]
    token_types: list[int]
    scores: list[float] | None = None
    special: object = None  # gguf.SpecialVocab (merges, special ids, chat template)
    add_space_prefix: bool | None = None
    extra: dict = field(default_factory=dict)

    def add_to(self, writer) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.token_types)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        self.special.add_to_gguf(writer, quiet=True)


def _looks_special(tok: str) -> bool:
    return (tok.startswith("<|") and tok.endswith("|>")) or \
        (tok.startswith("<｜") and tok.endswith("｜>")) or tok in ("<pad>", "<mask>") or \
        (tok.startswith("<unused") and tok.endswith(">"))


def _components(node: dict | None, key: str) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [c for sub in node.get(key, []) for c in _components(sub, key)]
    return [node]


def _kind(tj: dict) -> str:
    model = tj.get("model", {})
    pres = [c.get("type") for c in _components(tj.get("pre_tokenizer"), "pretokenizers")]
    norms = _components(tj.get("normalizer"), "normalizers")
    if model.get("type") != "BPE":
        raise UnsupportedTokenizer(
            f"tokenizer.json model type {model.get('type')!r} cannot be written to GGUF by quantkit.",
            "quantkit writes byte-level BPE (gpt2) and SentencePiece-style BPE (llama) tokenizers.")
    if "ByteLevel" in pres:
        return "gpt2"
    spm_norm = any(n.get("type") in ("Prepend", "Replace") and "▁" in json.dumps(n, ensure_ascii=False)
                   for n in norms)
    if model.get("byte_fallback") and ("Metaspace" in pres or spm_norm):
        return "llama"
    raise UnsupportedTokenizer(
        f"BPE tokenizer with pre-tokenizers {pres} and no byte-level or SentencePiece layout.",
        "llama.cpp would tokenize it differently; convert it with llama.cpp's own tools.")


def _structural_pre(tok) -> str | None:
    """llama.cpp pre-tokenizer name whose regex equals the HF tokenizer's, if any."""
    state = json.loads(tok.backend_tokenizer.to_str())
    norms = [n.get("type") for n in _components(state.get("normalizer"), "normalizers")]
    if norms not in ([], ["NFC"]):
        return None  # llama.cpp's BPE path applies no normalizer (NFC: as for real Qwen models)
    sig = []
    for c in _components(state.get("pre_tokenizer"), "pretokenizers"):
        kind = c.get("type")
        if kind == "Split" and c.get("behavior") == "Isolated" and not c.get("invert"):
            sig.append(("Split", (c.get("pattern") or {}).get("Regex")))
        elif kind == "ByteLevel" and not c.get("add_prefix_space"):
            sig.append(("ByteLevel", bool(c.get("use_regex", True))))
        elif kind == "Digits":
            sig.append(("Digits", bool(c.get("individual_digits"))))
        else:
            return None
    return next((name for name, want in _STRUCTURAL.items() if tuple(sig) == want), None)


def _add_flags(tok) -> tuple[bool, bool]:
    """Does the HF tokenizer itself prepend BOS / append EOS when encoding?"""
    plain = tok.encode("Hello world", add_special_tokens=False)
    full = tok.encode("Hello world", add_special_tokens=True)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    add_bos = len(full) > len(plain) and bos is not None and full[0] == bos
    add_eos = len(full) > len(plain) and eos is not None and full[-1] == eos
    return add_bos, add_eos


def bpe_merges(tj: dict) -> list[str]:
    """tokenizer.json merges as GGUF wants them: "a b", a space inside a part written as
    U+0120 (what gguf's SpecialVocab(load_merges=True) makes, without a second parse of the
    file and its per-character loop: 0.4 s for a 49K-merge vocabulary)."""
    merges = tj.get("model", {}).get("merges") or []
    if merges and isinstance(merges[0], str):
        return list(merges)
    if merges and not (isinstance(merges[0], list) and len(merges[0]) == 2):
        raise UnsupportedTokenizer("Unknown tokenizer.json merges format.",
                                   "Expected 'a b' strings or [a, b] pairs.")
    return [a.replace(" ", "\u0120") + " " + b.replace(" ", "\u0120") for a, b in merges]


def read_tokenizer(source_dir: Path, vocab_size: int | None) -> TokenizerExport:
    """Everything `tokenizer.ggml.*` needs, or UnsupportedTokenizer with the reason."""
    with _gc_paused():
        return _read_tokenizer(Path(source_dir), vocab_size)


@contextlib.contextmanager
def _gc_paused():
    """Reading a vocabulary makes ~10^5 containers (JSON, token lists), and every few hundred
    of them the cyclic GC walks the whole process (torch + transformers: ~4*10^5 objects).
    Paused, reading SmolLM2's tokenizer took 0.60 s instead of 0.86 s; it makes no cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_tokenizer(source_dir: Path, vocab_size: int | None) -> TokenizerExport:
    import gguf

    from quantkit.model_io import load_tokenizer
    from quantkit.readers import read_json

    tj_file = source_dir / "tokenizer.json"
    if not tj_file.is_file():
        hint = ("Save the fast tokenizer (tokenizer.json) with transformers first."
                if (source_dir / "tokenizer.model").is_file() else
                "The model directory needs tokenizer.json.")
        raise UnsupportedTokenizer(f"No tokenizer.json in {source_dir}.", hint)
    tj = read_json(tj_file)
    kind = _kind(tj)
    tok = load_tokenizer(source_dir)
    add_bos, add_eos = _add_flags(tok)
    cfg = read_json(source_dir / "tokenizer_config.json") \
        if (source_dir / "tokenizer_config.json").is_file() else {}
    space_prefix = cfg.get("add_prefix_space") if isinstance(cfg.get("add_prefix_space"), bool) else None
    if kind == "llama":
        vocab = gguf.LlamaHfVocab(source_dir)
        tokens, scores, types = [], [], []
        for text, score, ttype in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(int(ttype))
        special = gguf.SpecialVocab(source_dir, n_vocab=len(tokens))
        out = TokenizerExport("llama", "default", tokens, types, scores, special, space_prefix)
    else:
        ids = tok.encode(CHKTXT)
        chkhsh = sha256(str(ids).encode()).hexdigest()
        pre = KNOWN_PRE.get(chkhsh) or _structural_pre(tok)
        if pre is None:
            raise UnsupportedTokenizer(
                f"Unknown BPE pre-tokenizer (probe hash {chkhsh[:16]}...): llama.cpp would "
                "split text differently from the HF tokenizer.",
                "Known: " + ", ".join(sorted(set(KNOWN_PRE.values()))) +
                ". Check llama.cpp's convert_hf_to_gguf_update.py for this tokenizer.")
        vocab = tok.get_vocab()
        n = vocab_size or len(vocab)
        if max(vocab.values()) >= n:
            raise UnsupportedTokenizer(f"Tokenizer has ids up to {max(vocab.values())} but the "
                                       f"model's vocab_size is {n}.")
        reverse = {i: t for t, i in vocab.items()}
        added = tok.added_tokens_decoder
        tokens, types = [], []
        for i in range(n):
            if i not in reverse:
                tokens.append(f"[PAD{i}]")
                types.append(UNUSED)
            elif i in added:
                t = added[i]
                tokens.append(t.content)
                types.append(CONTROL if (t.special or _looks_special(t.content)) else USER_DEFINED)
            else:
                tokens.append(reverse[i])
                types.append(NORMAL)
        special = gguf.SpecialVocab(source_dir, n_vocab=n)  # ids, add flags, chat template
        special.merges = bpe_merges(tj)
        if not special.merges:
            raise UnsupportedTokenizer("BPE tokenizer without merges cannot be written to GGUF.")
        out = TokenizerExport("gpt2", pre, tokens, types, None, special, space_prefix)
    out.special.add_special_token["bos"] = add_bos
    out.special.add_special_token["eos"] = add_eos
    return out
