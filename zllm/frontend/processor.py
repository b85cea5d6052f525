"""Validates user input and turns it into AddRequest messages for the engine core.

Every check raises ValueError naming the offending field, before anything reaches the engine.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Union

import msgspec
import numpy as np
from transformers import PreTrainedTokenizerBase

from zllm.frontend.lora_adapters import LoRAAdapters
from zllm.frontend.multimodal import ImageProcessor
from zllm.grammars import grammar_of
from zllm.ipc.messages import AddPoolingBatch, AddRequest, ImageInput
from zllm.lora import LoRARequest
from zllm.pooling import PoolerConfig, PoolingParams, check_pooling
from zllm.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any]]


class InputProcessor:
    @classmethod
    def from_config(cls, config, tokenizer: PreTrainedTokenizerBase | None) -> InputProcessor:
        """Limits from the engine config and the model's own config (vocabulary, EOS ids)."""
        from transformers import AutoConfig

        from zllm.frontend.tokenizer import eos_token_ids

        hf_config = AutoConfig.from_pretrained(config.model)
        vocab_size = hf_config.get_text_config().vocab_size
        return cls(
            tokenizer,
            config.max_model_len,
            vocab_size,
            eos_token_ids(config.model, tokenizer),
            max_logprobs=config.max_logprobs,
            max_n=config.max_n,
            scheduling_policy=config.scheduling_policy,
            pooler=config.pooler,
            images=_image_processor(config, hf_config),
            adapters=LoRAAdapters(config) if config.enable_lora else None,
        )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,  # None: skip_tokenizer_init (token ids only)
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        max_logprobs: int = 20,
        max_n: int = 128,
        scheduling_policy: str = "fcfs",
        pooler: PoolerConfig | None = None,
        images: ImageProcessor | None = None,
        adapters: LoRAAdapters | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_logprobs = max_logprobs
        self.max_n = max_n
        self.scheduling_policy = scheduling_policy
        self.pooler = pooler  # set: a pooling model, which serves pooling requests only
        self.images = images  # set: a vision-language model, which takes images
        self.adapters = adapters  # set: LoRA adapters are served (enable_lora)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        sampling: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
        tokenized: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> tuple[AddRequest, str | None]:
        """Returns the message for the engine core and the prompt text (None for token ids).
        A prompt dict may carry a "cache_salt" (as in vLLM); `cache_salt` here is the same.
        `pooling`: a pooling request (the only kind a pooling model serves); a prompt dict may
        then carry the "token_type_ids" of a text pair. `tokenized`: the prompt dict's ids came
        from this processor's own tokenizer (LLM's batch call), so they need no checking.
        `lora_request`: the adapter that serves it (None: the base model)."""
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(sampling).__name__}")
        self._check_task(pooling)
        self._check_sampling(sampling)
        self._check_priority(priority)
        self._check_lora(lora_request)
        text, token_ids = (prompt.get("prompt"), prompt["prompt_token_ids"]) if tokenized else self._tokenize(prompt)
        keep = self.kept_tokens(
            pooling.truncate_prompt_tokens if pooling is not None else sampling.truncate_prompt_tokens
        )
        token_ids = self.truncated(token_ids, keep, text)
        token_ids, mm_inputs = self._with_images(prompt, token_ids)
        self._check_length(token_ids)
        if pooling is not None:
            pooling = self._with_token_types(pooling, prompt, len(token_ids), keep)
        message = AddRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=sampling,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=self._cache_salt(prompt, cache_salt),
            bad_words_token_ids=self._bad_words_token_ids(sampling.bad_words or []),
            pooling=pooling,
            mm_inputs=mm_inputs,
            lora=lora_request,
        )
        return message, text

    def process_pooling_batch(
        self,
        batch_id: str,
        prompts: list[PromptType],
        token_ids: list[list[int] | None],
        pooling: PoolingParams,
    ) -> tuple[AddPoolingBatch, list[list[int]]]:
        """Many pooling inputs under one PoolingParams as one message (LLM.embed's batch path):
        the shared parameters checked once, every length at once. `token_ids[i]`: prompt i's ids
        from this processor's own tokenizer (trusted, as `process`'s `tokenized`), or None: the
        prompt is read and checked as `process` reads it. Only plain inputs (text or token ids:
        no images, no token types) go this way. Returns the message and each input's token ids
        (the outputs' prompt_token_ids)."""
        self._check_task(pooling)
        token_ids = [self._tokenize(prompt)[1] if ids is None else ids for prompt, ids in zip(prompts, token_ids)]
        keep = self.kept_tokens(pooling.truncate_prompt_tokens)
        if keep is not None:
            token_ids = [self.truncated(ids, keep, _text_of(prompt)) for prompt, ids in zip(prompts, token_ids)]
        lengths = np.fromiter(map(len, token_ids), np.int32, count=len(token_ids))
        if len(lengths) and int(lengths.max()) > self.max_model_len:
            self._check_length(token_ids[int((lengths > self.max_model_len).argmax())])  # the first too long
        flat = np.fromiter(itertools.chain.from_iterable(token_ids), np.int32, count=int(lengths.sum()))
        return AddPoolingBatch.of(batch_id, flat, lengths, pooling, time.time()), token_ids

    def _with_images(self, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], list[ImageInput]]:
        """A prompt dict's "multi_modal_data" {"image": image or list}: the placeholders expanded;
        or its "mm_inputs", images the HTTP API processed already (off the serving loop)."""
        if isinstance(prompt, dict) and prompt.get("mm_inputs"):
            return token_ids, self._checked_inputs(token_ids, prompt["mm_inputs"])
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return token_ids, []
        if self.images is None:
            raise ValueError("multi_modal_data: this model takes text only")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError('multi_modal_data: expected {"image": a PIL image or a list of them}')
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        self.images.check_count(len(images))
        return self.images.expand(token_ids, images, prompt.get("mm_processor_kwargs"))

    def _checked_inputs(self, token_ids: list[int], inputs: list[ImageInput]) -> list[ImageInput]:
        if self.images is None:
            raise ValueError("multi_modal_data: this model takes text only")
        self.images.check_count(len(inputs))
        placeholder = self.images.vision.image_token_id
        for image in inputs:
            span = token_ids[image.offset : image.offset + image.length]
            if image.length < 1 or len(span) != image.length or any(t != placeholder for t in span):
                raise ValueError("multi_modal_data: an image's tokens are not its placeholders in the prompt")
        return list(inputs)

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if self.adapters is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters; start it with enable_lora")
        self.adapters.check(lora_request)

    def _check_task(self, pooling: PoolingParams | None) -> None:
        """A pooling model serves pooling requests only, a generative model none."""
        if self.pooler is None:
            if pooling is not None:
                raise ValueError(f"task: {pooling.task!r} needs a pooling model; this model generates text")
            return
        if pooling is None:
            raise ValueError(
                "task: this is a pooling model (embeddings, scores, classes); it cannot generate text: "
                "use /v1/embeddings, /score, /rerank or /classify (LLM.embed, score, classify, encode)"
            )
        check_pooling(pooling, self.pooler)

    def tokenize_pair(self, first: str, second: str, truncate_prompt_tokens: int | None = None) -> dict:
        """A text pair as one input (a cross-encoder's query and document), with its token types."""
        return self.tokenize_pairs([first], [second], truncate_prompt_tokens)[0]

    def tokenize_pairs(
        self, firsts: list[str], seconds: list[str], truncate_prompt_tokens: int | None = None
    ) -> list[dict]:
        """Text pairs as inputs, tokenized in one call; each with its token types where the
        tokenizer makes them (BERT's segments). truncate_prompt_tokens: at most that many tokens
        a pair, by the tokenizer's left truncation (the longer text loses its first tokens)."""
        for name, texts in (("text_1", firsts), ("text_2", seconds)):
            if not all(isinstance(text, str) and text for text in texts):
                raise ValueError(f"{name}: must be non-empty strings")
        keep = self.kept_tokens(truncate_prompt_tokens)
        if keep is None:
            encoded = self.tokenizer(list(firsts), list(seconds))
        else:
            encoded = self._left_truncating(list(firsts), list(seconds), keep)
        types = encoded.get("token_type_ids")
        return [
            {"prompt_token_ids": list(ids)} | ({} if types is None else {"token_type_ids": list(types[i])})
            for i, ids in enumerate(encoded["input_ids"])
        ]

    def kept_tokens(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of a prompt's last tokens truncate_prompt_tokens keeps (-1: max_model_len);
        None: all of them. More than max_model_len is refused, as vLLM does."""
        if truncate_prompt_tokens is None:
            return None
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {keep} exceeds the model's max_model_len ({self.max_model_len})")
        return keep

    def truncated(self, token_ids: list[int], keep: int | None, text: str | None = None) -> list[int]:
        """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens). Token ids the caller
        gave are sliced; a text is tokenized again with the tokenizer's own left truncation
        (as vLLM's tokenizer call does), which keeps the special tokens it adds (BERT's [CLS] and
        [SEP], a BOS) and drops the text's first tokens. Only an input over `keep` costs anything."""
        if keep is None or len(token_ids) <= keep:
            return token_ids
        if text is None or self.tokenizer is None:
            return token_ids[-keep:]
        return self._left_truncating(text, None, keep)["input_ids"]

    def _left_truncating(self, text, pair, keep: int) -> dict:
        """The tokenizer's call with truncation from the left (its longest_first strategy for
        pairs: the longer text loses tokens first), the tokenizer's setting restored after."""
        side, self.tokenizer.truncation_side = self.tokenizer.truncation_side, "left"
        try:
            return self.tokenizer(text, pair, truncation=True, max_length=keep)
        finally:
            self.tokenizer.truncation_side = side

    @staticmethod
    def _with_token_types(
        pooling: PoolingParams, prompt: PromptType, num_tokens: int, keep: int | None = None
    ) -> PoolingParams:
        """The prompt dict's token types (a text pair's), truncated as its tokens were."""
        token_types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if token_types is None:
            return pooling
        token_types = token_types[-keep:] if keep else token_types
        if len(token_types) != num_tokens or not all(t in (0, 1) for t in token_types):
            raise ValueError(f"token_type_ids: must be {num_tokens} values of 0 or 1, one per token")
        return msgspec.structs.replace(pooling, token_type_ids=list(token_types))

    def _check_sampling(self, sampling: SamplingParams) -> None:
        """The limits that depend on this engine: its config and its vocabulary."""
        if sampling.n > self.max_n:
            raise ValueError(f"n: must be between 1 and max_n ({self.max_n}), got {sampling.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(sampling, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}: {value} is more than max_logprobs ({self.max_logprobs})")
        if self.tokenizer is None:
            _check_without_tokenizer(sampling)
        self._check_token_ids(sampling.stop_token_ids or [], "stop_token_ids")
        self._check_token_ids(list(sampling.logit_bias or {}), "logit_bias")
        if sampling.structured_outputs is not None:
            grammar_of(sampling.structured_outputs)  # what xgrammar cannot build is refused here

    def _check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer, got {type(priority).__name__}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority: {priority} needs scheduling_policy='priority' (this engine uses "
                f"{self.scheduling_policy!r}); start it with --scheduling-policy priority"
            )

    @staticmethod
    def _cache_salt(prompt: PromptType, cache_salt: str | None) -> str | None:
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        return cache_salt

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token sequences, alone and after a space (as it appears mid-text)."""
        sequences: list[list[int]] = []
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: this engine runs without a tokenizer (skip_tokenizer_init): "
                    'give {"prompt_token_ids": [...]} instead of text'
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            # NOTE: the types of the ids as a set (`type(t) is int`, not isinstance: bools are
            # refused), built in C: an offline batch of pooling inputs checks every token here.
            if not isinstance(token_ids, list) or not set(map(type, token_ids)) <= _INT:
                raise ValueError("prompt_token_ids: must be a list of integers")
            if not token_ids:
                raise ValueError("prompt_token_ids: must not be empty")
            self._check_token_ids(token_ids, "prompt_token_ids")
            return prompt.get("prompt"), list(token_ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"prompt: expected a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _check_length(self, token_ids: list[int]) -> None:
        if self.pooler is not None:
            if len(token_ids) > self.max_model_len:
                raise ValueError(
                    f"input: {len(token_ids)} tokens exceed the model's maximum of {self.max_model_len} tokens"
                )
            return
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )

    def _check_token_ids(self, token_ids: list[int], field: str) -> None:
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{field}: token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")


_INT = {int}


def _text_of(prompt: PromptType) -> str | None:
    """A prompt's text (a string, or a dict's "prompt"), None for token ids."""
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None


def _check_without_tokenizer(sampling: SamplingParams) -> None:
    """Without a tokenizer (skip_tokenizer_init) nothing that needs text can be honoured."""
    needs_text = {
        "stop": sampling.stop_strings,
        "bad_words": sampling.bad_words,
        "structured_outputs": sampling.structured_outputs,
    }
    for name, value in needs_text.items():
        if value:
            raise ValueError(f"{name}: needs a tokenizer; this engine runs without one (skip_tokenizer_init)")


def _image_processor(config, hf_config) -> ImageProcessor | None:
    """A vision-language model's image processor; None for a text model."""
    from zllm.model_spec import VISION_ARCHITECTURES, ModelSpec

    if not set(getattr(hf_config, "architectures", None) or []) & set(VISION_ARCHITECTURES):
        return None
    vision = ModelSpec.from_hf_config(hf_config).vision
    return ImageProcessor(config.model, vision, config.mm_processor_kwargs, config.limit_mm_per_prompt.get("image"))
