"""Whether a `generate` request's prompt fits a row: the positions a row holds and the prompt's token ids checked
against them, before the request takes a row (actor_node/generation_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actor_node.responses import GenerationError, prompt_chars, prompt_texts, render_prompt
from models import scoring


@dataclass(frozen=True)
class PromptFit:
    """The positions a row holds (`capacity`: the actor's max_generate_positions, or the model's limit where that is
    lower) and the longest token of the tokenizer, in characters (None where the vocabulary does not bound it)."""

    capacity: int
    capacity_names_model: bool  # the model's limit is the bound (the refusal names it)
    longest_token: int | None

    @classmethod
    def of(cls, model: Any, tokenizer: Any, max_positions: int) -> PromptFit:
        limit = scoring.position_limit(model)
        capacity = min(max_positions, limit) if limit is not None else max_positions
        return cls(capacity, limit is not None and limit <= max_positions, scoring.longest_token_chars(tokenizer))

    @property
    def max_prompt_chars(self) -> int | None:
        """No token covers more characters than the tokenizer's longest token: a prompt of more characters than
        capacity x that has more tokens than the capacity, known without tokenizing it (a 999,000-character prompt
        took 23.9 s to tokenize, every other row waiting, only to be refused)."""
        return self.capacity * self.longest_token if self.longest_token else None

    def prompt_ids(self, tokenizer: Any, obs: dict[str, Any], max_new_tokens: int) -> list[int]:
        """The prompt's token ids; GenerationError where the prompt and `max_new_tokens` do not fit a row."""
        # The length with white space first: it bounds the count without it, which costs a copy of the prompt.
        bound = self.max_prompt_chars
        if bound is not None and sum(map(len, prompt_texts(obs))) > bound and (chars := prompt_chars(obs)) > bound:
            raise GenerationError(
                f"the prompt's {chars} characters (white space not counted) cannot fit in {self.capacity} positions: no"
                f" token of this model's tokenizer covers more than {self.longest_token} characters (refused before tokenizing)"
            )
        prompt_ids = render_prompt(tokenizer, obs)
        if len(prompt_ids) + max_new_tokens > self.capacity:
            limit = "the model's limit" if self.capacity_names_model else "the actor's limit (max_generate_positions)"
            raise GenerationError(
                f"the prompt's {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} = "
                f"{len(prompt_ids) + max_new_tokens} positions, over {limit} of {self.capacity}"
            )
        return prompt_ids
