"""Tokenizer and chat template for the runtime: the ``tokenizers`` library plus jinja2 (no
transformers). Files come from the engine's ``tokenizer/`` folder."""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from dspark_runtime.errors import InputError, ManifestError


def _raise(msg):
    raise InputError(f"chat template refused the messages: {msg}")


class Tokenizer:
    """Encode/decode text and render the model's chat template.

    Args:
        folder: holds ``tokenizer.json`` and optionally ``chat_template.jinja``.
        chat_template: template text (overrides the file).
    """

    def __init__(self, folder: str | Path, chat_template: str | None = None):
        from tokenizers import Tokenizer as _Tok

        folder = Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise ManifestError(f"{tj} is missing; rebuild the engine")
        self._tok = _Tok.from_file(str(tj))
        if chat_template is None and (folder / "chat_template.jinja").is_file():
            chat_template = (folder / "chat_template.jinja").read_text()
        self.chat_template = chat_template
        self._template = None
        special = {}
        cfg = folder / "tokenizer_config.json"
        if cfg.is_file():
            special = json.loads(cfg.read_text())
        self.bos_token = special.get("bos_token") if isinstance(special.get("bos_token"), str) else None
        self.eos_token = special.get("eos_token") if isinstance(special.get("eos_token"), str) else None

    def encode(self, text: str) -> list:
        """Token ids of ``text``; special-token strings in it (e.g. ``<|im_start|>``) map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of ``ids`` with special tokens removed."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a UTF-8 character): its
        vocabulary string mapped back through the GPT-2 byte alphabet where the tokenizer decodes byte-level, else
        the UTF-8 of its decoded text. Special tokens give their own text. Raises InputError for an unknown id."""
        from tokenizers import decoders

        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise InputError(f"token id {token_id} is not in the tokenizer's vocabulary")
        if isinstance(self._tok.decoder, decoders.ByteLevel):
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        return self._tok.decode([int(token_id)], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template.

        Raises InputError when the model has no chat template (use raw prompts then) or the
        messages are malformed.
        """
        if not self.chat_template:
            raise InputError("this model has no chat template; pass a raw prompt (--raw)")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InputError(f"a chat message must be {{'role': ..., 'content': ...}}, got {m!r}")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **k: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     tools=None)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """The GPT-2 byte-level alphabet, character -> byte (the inverse of its ``bytes_to_unicode``: printable bytes map
    to themselves, the others to code points from 256 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table
