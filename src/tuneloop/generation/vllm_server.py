"""Completions sampled on a vLLM server (started by `tuneloop vllm-serve CONFIG`), from the weights of the latest
optimizer step, which weight_sync.py sends it before each generation.

The protocol, all HTTP on the server's OpenAI port (the standard library's client: nothing to install):
- GET /v1/models: the served model (its name, the path it loaded) and its max_model_len, checked before any data is
  read (`check_server`);
- POST /v1/completions: one request per completion, token ids in (`prompt` a list of ids, so the server's tokenizer
  never re-reads a prompt), token ids and each sampled token's log-prob out (`return_token_ids`, `logprobs: 0`),
  each with a seed of its own (one seed for a group would give its completions the same draws), all sent at once so
  the engine batches them. The server runs with `--logprobs-mode processed_logprobs`: the log-probs are those of
  the distribution sampled (after temperature), what the trainer computes.

Reproducible: a completion is a function of its prompt, its seed and the weights, so a resumed run (which sends the
checkpoint's weights first) asks for what the uninterrupted one did; the draws are the same wherever the server's
arithmetic does not depend on how it batched the requests (vLLM's CPU kernels here: seen bit-identical).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from tuneloop.errors import UserError
from tuneloop.generation.interface import Generated

# `trl.generation_kwargs` keys that are vLLM sampling parameters, sent as they are; and transformers' names of the
# same settings (the config may be shared with the transformers path), translated
VLLM_SAMPLING_KEYS = {"presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
                      "min_p", "min_tokens", "stop_token_ids", "ignore_eos", "logit_bias", "allowed_token_ids",
                      "bad_words"}
FROM_TRANSFORMERS = {"min_new_tokens": "min_tokens"}
# the server's waiting and answering, in seconds
POLL_SECONDS = 1.0
REQUEST_SECONDS = 600.0


def server_url(cfg) -> str:
    """The server's base URL: trl.vllm_server_base_url, else host and port (trl's, else the `vllm:` block's)."""
    settings, block = cfg.trl_settings, cfg.vllm
    if settings.vllm_server_base_url:
        return settings.vllm_server_base_url.rstrip("/")
    host = settings.vllm_server_host or (block.host if block else "0.0.0.0")
    port = settings.vllm_server_port or (block.port if block else 8000)
    return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"


def server_is_local(cfg) -> bool:
    """Whether the server runs on this machine (a loopback address): it then reads the weights from memory."""
    host = urllib.parse.urlparse(server_url(cfg)).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def sampling_request(settings, stops: list) -> dict:
    """The sampling part of a /v1/completions request, from the trl block (generation_kwargs on top, as TRL)."""
    request = {"max_tokens": settings.max_completion_length, "temperature": settings.temperature,
               "top_p": settings.top_p, "top_k": settings.top_k or -1, "min_p": settings.min_p or 0.0,
               "repetition_penalty": settings.repetition_penalty, "logprobs": 0, "return_token_ids": True,
               "skip_special_tokens": False}
    for key, value in (settings.generation_kwargs or {}).items():
        request[FROM_TRANSFORMERS.get(key, key)] = value
    request["stop_token_ids"] = sorted(set(stops) | set(request.get("stop_token_ids") or []))
    if settings.regex:
        request["structured_outputs"] = {"regex": settings.regex}
    return request


def check_vllm_generation_kwargs(settings) -> None:
    for key in settings.generation_kwargs or {}:
        if key in ("max_new_tokens", "max_tokens", "max_length"):
            raise UserError(f"config: `trl.generation_kwargs.{key}`: a completion's length is "
                            "`trl.max_completion_length`; set that instead")
        if key == "stop":
            raise UserError("config: `trl.generation_kwargs.stop` stops at strings, which cuts a completion inside a "
                            "token the trainer then reads whole: use `stop_token_ids`")
        if key not in VLLM_SAMPLING_KEYS and key not in FROM_TRANSFORMERS:
            raise UserError(f"config: `trl.generation_kwargs.{key}` is not a vLLM sampling parameter tuneloop sends "
                            f"(generation runs on vLLM: trl.use_vllm); the ones it sends are "
                            f"{', '.join(sorted(VLLM_SAMPLING_KEYS | set(FROM_TRANSFORMERS)))}")


class VLLMServer:
    """The HTTP calls tuneloop makes to a vLLM server."""

    def __init__(self, url: str):
        self.url = url

    def call(self, path: str, body: dict | None = None, timeout: float = REQUEST_SECONDS):
        """The JSON the server answers (None for an empty answer); OSError when it cannot be reached, RuntimeError
        with its message when it answers with an error."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"},
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                text = answer.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:400]
            raise RuntimeError(f"HTTP {error.code} from {path}: {detail}") from None
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError:  # (the LoRA endpoints answer in plain text)
            return text.decode(errors="replace")

    def served_model(self, wait_seconds: float) -> dict:
        """/v1/models' first entry, waiting up to `wait_seconds` for the server to come up."""
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                return self.call("/v1/models", timeout=10)["data"][0]
            except RuntimeError as error:
                if "HTTP 404" in str(error) and self._is_trl_server():
                    raise UserError(f"trl.use_vllm: the server at {self.url} is TRL's `trl vllm-serve`, whose weights "
                                    "reach it only over NCCL from TRL's own trainer (a GPU collective tuneloop does "
                                    "not open); start `tuneloop vllm-serve CONFIG` instead (vLLM's OpenAI server, "
                                    "synced through files)") from None
                if time.monotonic() >= deadline:
                    raise UserError(f"trl.use_vllm: the server at {self.url} is not vLLM's OpenAI server "
                                    f"({_reason(error)}): start it with `tuneloop vllm-serve CONFIG`") from None
                time.sleep(POLL_SECONDS)
            except (OSError, KeyError, IndexError, ValueError) as error:
                if time.monotonic() >= deadline:
                    raise UserError(f"trl.use_vllm: no vLLM server answers at {self.url} ({_reason(error)}) after "
                                    f"{wait_seconds:g} s: start it with `tuneloop vllm-serve CONFIG` (same config), "
                                    "or point trl.vllm_server_host/vllm_server_port at it") from None
                time.sleep(POLL_SECONDS)

    def _is_trl_server(self) -> bool:
        """TRL's server answers /get_world_size/ (and has no OpenAI routes)."""
        try:
            return "world_size" in (self.call("/get_world_size/", timeout=10) or {})
        except (OSError, RuntimeError, ValueError, TypeError):
            return False


def check_server(cfg, wait_seconds: float | None = None) -> dict:
    """Before any data is read: the server answers, serves the config's base model, and holds a prompt and its
    longest completion (sequence_len). Returns what it said (/v1/models' entry)."""
    settings = cfg.trl_settings
    url = server_url(cfg)
    served = VLLMServer(url).served_model(settings.vllm_server_timeout if wait_seconds is None else wait_seconds)
    model = str(cfg.base_model)
    if model not in (served.get("root"), served.get("id")):
        raise UserError(f"trl.use_vllm: the vLLM server at {url} serves {served.get('root') or served.get('id')!r}, "
                        f"and this run trains {model!r}: start the server with `tuneloop vllm-serve CONFIG` on this "
                        "config")
    length = served.get("max_model_len")
    wanted = cfg.vllm.max_model_len if cfg.vllm is not None else None
    if length is not None and wanted is not None and length != wanted:
        raise UserError(f"trl.use_vllm: the vLLM server at {url} runs with max_model_len {length}, and `vllm."
                        f"max_model_len` says {wanted}: restart the server with `tuneloop vllm-serve CONFIG`")
    if length is not None and length < cfg.sequence_len:
        raise UserError(f"trl.use_vllm: the vLLM server at {url} holds {length} tokens (max_model_len), and a prompt "
                        f"with its completion may take sequence_len {cfg.sequence_len}: restart it with "
                        f"`vllm.max_model_len: {cfg.sequence_len}` or more")
    return served


class VLLMEngine:
    """Generation on the server (see the module's text); `sync` is weight_sync.py's."""

    name = "vllm"
    gives_log_probs = True

    def __init__(self, cfg, served: dict, weight_sync):
        self.settings = cfg.trl_settings
        self.server = VLLMServer(server_url(cfg))
        self.served_name = served["id"]
        self.weight_sync = weight_sync

    def sync(self, policy, step: int) -> None:
        self.weight_sync.send(self.server, policy, step)

    def generate(self, policy, prompt_ids: list, seed: int, stops: list, autocast=None,
                 max_tokens: int | None = None) -> Generated:
        start = time.perf_counter()
        base = {"model": self.weight_sync.model_name or self.served_name, **sampling_request(self.settings, stops),
                **({"max_tokens": max_tokens} if max_tokens is not None else {})}
        requests = [{**base, "prompt": [int(token) for token in ids], "seed": (seed * 1_000_003 + index) % (2 ** 31)}
                    for index, ids in enumerate(prompt_ids)]
        with ThreadPoolExecutor(max_workers=min(64, len(requests))) as pool:
            answers = list(pool.map(self._complete, requests))
        tokens = [answer["token_ids"] for answer in answers]
        log_probs = [answer["logprobs"]["token_logprobs"] for answer in answers]
        return Generated(tokens, log_probs, time.perf_counter() - start)

    def _complete(self, request: dict) -> dict:
        try:
            return self.server.call("/v1/completions", request)["choices"][0]
        except (OSError, RuntimeError, KeyError, IndexError, ValueError) as error:
            raise UserError(f"the vLLM server at {self.server.url} failed a completion ({_reason(error)})") from None


def _reason(error: Exception) -> str:
    if isinstance(error, urllib.error.URLError):
        return str(error.reason)
    return str(error) or type(error).__name__
