"""The learner's models: the policy (same scoring as the actor, with gradients), the reference, the critic.

- Policy: the base LM with its LoRA adapter; candidate log-probabilities from
  `models.scoring` (packed layout), normalised and softmaxed exactly as the actor does.
- Reference: the same base with the adapter disabled (no copy); with
  `lora_rank 0` (all weights trained) a frozen copy of the starting weights.
- Critic (TWOSOME's design): an MLP value head on the frozen base's final hidden
  state at the last token of the context, i.e. exactly the text the policy sees
  (prompt + question), adapter disabled. The base is frozen, so these features
  are computed once per observation and the head trains on them alone. Generated
  responses have a head of their own (`token_value_head`): a value per response
  token, from the base's hidden state before that token.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from common.segments import CandidateObservation
from models import scoring


class ValueHead(nn.Module):
    def __init__(self, width: int, hidden: Sequence[int] = (1024, 512)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float()).squeeze(-1)


class LearnerPolicy:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        normalisation: str,
        temperature: float,
        value_hidden: Sequence[int],
        path: str = "packed",
        token_value_hidden: Sequence[int] = (256,),
        gradient_checkpointing: bool = False,
        generation_layout: str = "packed",
        frozen: Any = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.normalisation = normalisation
        self.temperature = temperature
        self.path = path
        self.generation_layout = generation_layout  # learner_node/token_update.py's check_layout picks it
        self.has_adapter = hasattr(model, "peft_config")
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            from models.policy_model import enable_gradient_checkpointing

            enable_gradient_checkpointing(model)
        # without an adapter, the reference: `frozen` (a sharded learner loads it already sharded), else a copy
        self.frozen = None
        if not self.has_adapter:
            self.frozen = (frozen if frozen is not None else copy.deepcopy(model)).eval()
            self.frozen.requires_grad_(False)
        device = next(model.parameters()).device
        width = model.get_output_embeddings().weight.shape[1]
        # token ids a transition may hold: an id past the embedding table would fail the whole update
        self.vocab_size = min(model.get_input_embeddings().num_embeddings, model.get_output_embeddings().weight.shape[0])
        # positions the model was built for: a longer sequence fails on a learned position table (GPT-2), or costs
        # attention memory quadratic in its length, so none is fed to it (see `tokenize_checked`)
        self.position_limit = scoring.position_limit(model)
        with device:  # built where they run: no host copy made first and moved
            self.value_head = ValueHead(width, value_hidden)
            # generate transitions: the value of each response token, from the same frozen features (learner_node/token_update.py)
            self.token_value_head = ValueHead(width, token_value_hidden)

    def tokenize(self, obs: CandidateObservation) -> scoring.Tokenized:
        return scoring.tokenize_observation(self.tokenizer, obs.prompt, obs.question or "", obs.action)

    def tokenize_checked(self, obs: CandidateObservation) -> scoring.Tokenized:
        """`tokenize`, raising ScoringError for an observation this model cannot score, before any forward: one
        that tokenizes to nothing (an empty prompt + question and a tokenizer that adds no BOS), or whose context
        and longest candidate run past the model's position limit (the actor's own check, actor_node/llm_policy.py).
        A client's `next_obs` reaches the learner with nothing but the broker's character limits checked."""
        item = self.tokenize(obs)
        scoring.check_length(item, self.position_limit)
        return item

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Forwards inside recompute their layers' activations in the backward pass, when the learner was started
        with gradient_checkpointing (its dropout is 0, so this is the same function); a no-op otherwise."""
        if not self.gradient_checkpointing:
            yield
            return
        self.model.train()
        try:
            yield
        finally:
            self.model.eval()

    @contextlib.contextmanager
    def base(self) -> Iterator[Any]:
        """The model with the adapter off (reference policy and critic features)."""
        if self.has_adapter:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.frozen

    def logp_all(self, items: Sequence[scoring.Tokenized], model: Any | None = None) -> list[torch.Tensor]:
        """log pi(a | s) over every candidate of every item (gradients flow if enabled)."""
        # With gradient checkpointing the update's forwards keep no KV cache between passes (a layer recomputed in
        # the backward pass would write it again): every pass of the learner scores so, the proximal and reference
        # ones too, so that the ratio is 1 to the bit at the first minibatch (scoring.score, WITHOUT_CACHE).
        sums = scoring.score(model or self.model, items, self.path, cache=not self.gradient_checkpointing)
        return [
            scoring.policy_logprobs(scoring.normalise(s.float(), item, self.normalisation), self.temperature)
            for s, item in zip(sums, items)
        ]

    @torch.no_grad()
    def reference_logp_all(self, items: Sequence[scoring.Tokenized]) -> list[torch.Tensor]:
        with self.base() as base:
            return self.logp_all(items, base)

    @torch.no_grad()
    def features(self, items: Sequence[scoring.Tokenized], batch: int = 8) -> torch.Tensor:
        """The frozen base's final hidden state at each context's last token, [N, width], float32."""
        device = next(self.model.parameters()).device
        out = []
        with self.base() as base:
            decoder = scoring.model_parts(base)[0]
            for start in range(0, len(items), batch):
                chunk = items[start : start + batch]
                longest = max(len(it.context) for it in chunk)
                ids = torch.zeros(len(chunk), longest, dtype=torch.long, device=device)
                mask = torch.zeros(len(chunk), longest, dtype=torch.long, device=device)
                for i, it in enumerate(chunk):
                    ids[i, : len(it.context)] = torch.tensor(it.context, device=device)
                    mask[i, : len(it.context)] = 1
                hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
                last = torch.tensor([len(it.context) - 1 for it in chunk], device=device)
                out.append(hidden[torch.arange(len(chunk), device=device), last].float())
        return torch.cat(out)

    @torch.no_grad()
    def values(self, observations: Sequence[CandidateObservation]) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic on observations: (the frozen base's features [N, width], the values [N]); ScoringError,
        before any forward, if one of them cannot be scored (`tokenize_checked`)."""
        return self.values_of([self.tokenize_checked(o) for o in observations])

    @torch.no_grad()
    def values_of(self, items: Sequence[scoring.Tokenized]) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic on tokenized observations: (features [N, width], values [N])."""
        features = self.features(items)
        return features, self.value_head(features)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]
