"""Tool turns as tokens: the tools' answers rendered with the model's chat template, the way
the template would write them after the assistant turn the model just generated.

The template is applied to a stand-in conversation (a user message, an assistant message
holding a sentinel, then one ``tool`` message per answer) with ``add_generation_prompt``;
the tool turn is everything after the sentinel: the end of the assistant turn the template
writes (``<|im_end|>\\n`` on Qwen), the tool messages in whatever form the template gives the
``tool`` role (Qwen's ``<tool_response>`` blocks in a user turn) and the next assistant
header. Where the model ended its turn with that end token itself, the token is not repeated.
The tokens are what the next assistant turn is generated after and what the trainer sees as
context (mask 0); the text never goes back through the template, so what the model generated
stays exactly as generated (verl's ``use_inference_chat_template=False``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SENTINEL", "ToolTurnRenderer"]

SENTINEL = "\ue000rlbus-assistant-turn\ue000"
"""A private-use string no template writes: where the generated assistant turn stands."""


class ToolTurnRenderer:
    """``hf``: the transformers tokenizer (with a chat template); ``schemas``: the tools'
    OpenAI schemas (the template's ``tools=``, as the prompt was rendered with);
    ``template_kwargs``: ``data.apply_chat_template_kwargs``."""

    def __init__(self, hf: Any, schemas: Sequence[Mapping[str, Any]],
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        if getattr(hf, "apply_chat_template", None) is None:
            raise ValueError("tool turns need a Hugging Face tokenizer with a chat template")
        self.hf = hf
        self.options: dict[str, Any] = {
            k: v for k, v in dict(template_kwargs or {}).items()
            if k not in ("tokenize", "return_dict", "return_tensors", "add_generation_prompt")}
        if schemas:
            self.options["tools"] = [dict(s) for s in schemas]

    def text(self, answers: Sequence[str], last_token: int | None) -> str:
        """The tool turn's text after an assistant turn whose last token is ``last_token``."""
        messages = [{"role": "user", "content": "?"},
                    {"role": "assistant", "content": SENTINEL},
                    *({"role": "tool", "content": a} for a in answers)]
        full = self.hf.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=False, **self.options)
        at = full.find(SENTINEL)
        if at < 0:
            raise ValueError("the chat template does not write the assistant's content")
        after: str = full[at + len(SENTINEL):]
        if last_token is not None:
            ended_with = self.hf.convert_ids_to_tokens(int(last_token))
            if isinstance(ended_with, str) and ended_with and after.startswith(ended_with):
                after = after[len(ended_with):]
        return after

    def tokens(self, answers: Sequence[str], last_token: int | None) -> list[int]:
        """The tool turn's token ids (encoded without special tokens added: the template
        wrote the ones it wants)."""
        return list(self.hf.encode(self.text(answers, last_token), add_special_tokens=False))
