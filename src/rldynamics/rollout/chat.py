"""Prompts from the tokenizer's own chat template, rendered turn by turn so trained tokens stay sampled tokens.

Design choices (docs/design.md §4.12):
- The conversation is rendered with `tokenizer.apply_chat_template` (any template: ChatML, Llama-3,
  Gemma, ...). The model's replies are never re-rendered: each assistant message is a unique placeholder,
  and what the template writes *after* that placeholder (end of turn, next user message, generation
  prompt) is the text appended behind the sampled reply tokens. So the token stream is exactly
  template(prompt) + sampled ids + template(between turns) + sampled ids + ..., and a template that
  rewrites earlier turns is detected (the new rendering must extend the previous one) and reported.
- A template without a system role (it raises or drops the system message) gets the system text at the
  top of the first user message.
- With `enable_think` every turn's generation prompt is followed by `<think>` (RAGEN's prompt); with
  `open_answer` (no think) by `<answer>` (RAGEN's no-think prompt). The parser is given the reply with that
  opener put back in front (`reply_prefix`), and the rendered history holds it in front of each reply.
- Generation stops at the template's end-of-turn token and at every EOS id of the tokenizer and of the
  model's generation config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

THINK_OPENER = "<think>"
ANSWER_OPENER = "<answer>"
_PLACEHOLDER = "RLDYNREPLY{}END"


@dataclass
class Conversation:
    """One trajectory's messages (assistant turns are placeholders) and their rendering so far."""

    messages: list[dict[str, str]] = field(default_factory=list)
    rendered: str = ""


class ChatPrompts:
    """Turn-by-turn prompt text of one tokenizer's chat template.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        enable_think: open a `<think>` block at every generation prompt.
        open_answer: without `enable_think`, open the `<answer>` block at every generation prompt.
        model: optional model whose generation config adds EOS ids to `stop_ids`.
    """

    def __init__(self, tokenizer, *, enable_think: bool = False, open_answer: bool = False, model=None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set "
                "model.chat_template=chatml (a plain ChatML template) or model.chat_template=<path to a Jinja file>")
        self.tokenizer = tokenizer
        self.reply_prefix = THINK_OPENER if enable_think else ANSWER_OPENER if open_answer else ""
        self.system_role = self._supports_system_role()
        self.end_of_turn = self._end_of_turn()
        self.stop_ids = self._stop_ids(model)

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        """The template's text of `messages` (with the assistant generation prompt if asked)."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def start(self, system: str, user: str) -> tuple[Conversation, str]:
        """A new conversation and the text of its first prompt (up to and including the generation prompt)."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        if not self.system_role:
            messages = [{"role": "user", "content": f"{system}\n\n{user}"}]
        conv = Conversation(messages=messages, rendered=self.render(messages, True))
        return conv, conv.rendered + self.reply_prefix

    def next_turn(self, conv: Conversation, user: str) -> str:
        """Text that follows the model's reply: end of its turn, the next user message, the generation prompt
        (and the reply opener, as after the first prompt)."""
        reply = self.reply_prefix + _PLACEHOLDER.format(len(conv.messages))
        conv.messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
        text = self.render(conv.messages, True)
        if not text.startswith(conv.rendered + reply):
            raise ValueError("the tokenizer's chat template rewrites earlier turns of a conversation, so sampled "
                             "tokens cannot be kept as trained tokens; set model.chat_template=chatml or a template "
                             "file that renders turns incrementally")
        new = text[len(conv.rendered) + len(reply):]
        conv.rendered = text
        return new + self.reply_prefix

    def _supports_system_role(self) -> bool:
        try:
            text = self.render([{"role": "system", "content": "SYSTEMTEXT"}, {"role": "user", "content": "hi"}], True)
        except Exception:  # templates signal "no system role" with a jinja exception of their own  # noqa: BLE001
            return False
        return "SYSTEMTEXT" in text

    def _end_of_turn(self) -> str:
        """The text a template writes after an assistant message's content (e.g. `<|im_end|>\\n`)."""
        reply = _PLACEHOLDER.format(0)
        text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}], False)
        return text[text.index(reply) + len(reply):]

    def _stop_ids(self, model) -> list[int]:
        ids = self.tokenizer(self.end_of_turn.strip(), add_special_tokens=False)["input_ids"]
        stops = [ids[0]] if len(ids) == 1 else []
        for eos in (self.tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None),
                                                         "eos_token_id", None)):
            for i in eos if isinstance(eos, list) else [eos]:
                if i is not None and i not in stops:
                    stops.append(int(i))
        if not stops:
            raise ValueError("cannot tell where a reply ends: the chat template's end of turn is not one token and "
                             "neither the tokenizer nor the model defines an EOS token")
        return stops

    def closing_ids(self) -> list[int]:
        """Token ids that close a reply cut off by the token limit (the template's end-of-turn marker)."""
        return self.tokenizer(self.end_of_turn.rstrip(), add_special_tokens=False)["input_ids"]
