"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`,
`LLM(...).embed(prompts, PoolingParams(...))`."""

from __future__ import annotations

from typing import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.metrics_reader import Metric, engine_metrics
from engine.processing.outputs import CompletionOutput, EmbeddingOutput, RequestOutput
from engine.sampling.pooling import PoolingParams
from engine.sampling.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Runs the paged engine in-process over a batch of prompts."""

    def __init__(
        self,
        model: str = "default",
        config: EngineConfig | None = None,
        parallel_group=None,
        **engine_args,
    ) -> None:
        """`config` (as parsed by the CLI) or `model` + EngineConfig fields as keywords.
        `parallel_group`: an existing tensor-parallel group to run on (LLMEngine's)."""
        self.engine = LLMEngine(
            config or EngineConfig(model=model, **engine_args), parallel_group=parallel_group
        )
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop (or release) the tensor-parallel ranks; nothing to do with one rank."""
        self.engine.close()

    # ---- weights lifecycle (vLLM's names; engine/lifecycle.py) -----------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1, weights offloaded to the CPU) or also drop the weights
        (level 2). Needs enable_sleep_mode."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def update_weights(self, weights) -> int:
        """New weights by HF name ((name, tensor) pairs or a safetensors path); bumps the
        weights version (part of every block hash) and resets the prefix cache."""
        return self.engine.update_weights(weights)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """Call `method` on every engine (here: one) or its worker extension; the results."""
        return self.engine.collective_rpc(method, args, kwargs)

    def get_metrics(self) -> list[Metric]:
        """The engine's counters so far (vLLM's `LLM.get_metrics()`): requests, KV usage,
        prefix cache, tokens, and with speculation its draft / accepted counts per position
        (acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted /
        drafts)."""
        return engine_metrics(self.engine.stats(), self.engine.proposer is not None)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults applied (vLLM's name;
        EngineConfig.generation_config chooses the source)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are text or token id lists.
        `sampling_params` None: `get_default_sampling_params()`. `priority`: one per prompt,
        lower runs first. `lora_request`: one adapter for all prompts or one per prompt
        (None: the base model); needs enable_lora."""
        prompt_list = _prompt_list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params_list = (
            [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"{len(priorities)} priorities for {len(prompt_list)} prompts")

        loras: list[LoRARequest | None]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
        if len(loras) != len(prompt_list):
            raise ValueError(f"{len(loras)} lora requests for {len(prompt_list)} prompts")
        results: dict[str, RequestOutput] = {}
        batch = zip(prompt_list, params_list, priorities, loras)
        for i, (prompt, p, prio, lora) in enumerate(batch):
            rid = f"offline-{i}"
            request = self.engine.add_request(rid, prompt, p, cache_salt, prio, lora_request=lora)
            results[rid] = RequestOutput(
                rid, request.prompt_token_ids, [CompletionOutput(j) for j in range(p.n)]
            )
        bar = tqdm(total=len(prompt_list), desc="generate", unit="req", disable=not use_tqdm)
        done = 0
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                out = results[delta.request_id]
                out.add(delta)
                if delta.finished and out.finished:
                    done += 1
                    bar.update(1)
        bar.close()
        return list(results.values())

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        cache_salt: str | None = None,
    ) -> list[EmbeddingOutput]:
        """One embedding per prompt, in order (vLLM's `LLM.embed`): the final-normed hidden
        state pooled over the prompt (`PoolingParams`: last token by default, normalized)."""
        prompt_list = _prompt_list(prompts)
        pooling = pooling_params or PoolingParams()
        results: dict[str, EmbeddingOutput] = {}
        for i, prompt in enumerate(prompt_list):
            request = self.engine.add_request(
                f"embed-{i}", prompt, SamplingParams(max_tokens=1), cache_salt, pooling=pooling
            )
            results[request.request_id] = EmbeddingOutput(
                request.request_id, request.prompt_token_ids, []
            )
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                out = results[delta.request_id]
                assert delta.embedding is not None  # a pooling request's one delta carries it
                out.embedding, out.num_cached_tokens = delta.embedding, delta.num_cached_tokens
        return list(results.values())


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]  # token ids: one prompt
    return list(prompts)  # type: ignore[arg-type]  # a sequence of prompts
