"""The config's sections: typed, frozen dataclasses, one per concern, with each key's default, range and
meaning. Loading, overrides, recipes and cross-section checks are zoff.config's (the package's __init__)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from zoff.config.schema import range_meta, to_dict

_rng = range_meta  # every size key has an upper bound too: a hostile config must not allocate or loop unboundedly


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters through peft (zoff/models/lora.py): r 0 is off. The base stays frozen (partitioned and
    offloadable at stage 3 like any frozen weight); only the adapters train and get optimizer state."""

    r: int = field(default=0, metadata=_rng(0, 65536))  # the adapters' rank; 0: no adapters
    alpha: float = field(default=16.0, metadata=_rng(0.0, gt=True))  # scale alpha / r
    dropout: float = field(default=0.0, metadata=_rng(0.0, 1.0))  # on the adapters' input
    # module names (suffixes) to adapt, as peft's target_modules; "all-linear": every Linear but the output head
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])

    @property
    def enabled(self) -> bool:
        return self.r > 0


@dataclass(frozen=True)
class ModelConfig:
    name: str = "gpt"  # builtin name, or python:pkg.module:factory (the factory receives this section)
    n_layer: int = field(default=4, metadata=_rng(1, 4096))  # gpt: transformer blocks
    n_head: int = field(default=4, metadata=_rng(1, 4096))  # gpt: attention heads (d_model divisible by it)
    d_model: int = field(default=128, metadata=_rng(1, 1 << 18))  # gpt: the residual stream's width
    vocab_size: int = field(default=256, metadata=_rng(2, 1 << 24))  # gpt: embedded ids (>= the tokenizer's)
    seq_len: int = field(default=128, metadata=_rng(1, 1 << 24))  # the model's maximum context
    dropout: float = field(default=0.0, metadata=_rng(0.0, 1.0))  # gpt: on attention and MLP outputs
    tie_embeddings: bool = True  # gpt: the output head shares the token embedding's weight
    # gpt: learned adds a trained table of seq_len x d_model positions (GPT-2's); rotary rotates each query and
    # key by its position (Llama's; no parameter grows with the context: long sequences want it)
    positions: Literal["learned", "rotary"] = "learned"
    rope_theta: float = field(default=10000.0, metadata=_rng(0.0, gt=True))  # gpt, rotary: the base period
    args: dict = field(default_factory=dict)  # free-form keyword arguments for python: factories
    config: dict = field(default_factory=dict)  # hf: models: keyword arguments of the transformers config
    # hf: models: the Hugging Face model to start from: a local folder, or a Hub id (owner/name) fetched before
    # any rank starts (only its config and safetensors files)
    path: str | None = None
    # path's Hub revision (branch, tag or commit); zoff train and validate pin it to the commit they fetched
    revision: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True)
class DataConfig:
    # stdlib-source: this Python's standard library .py files; text, jsonl, parquet: the files in paths; hf:
    # datasets.load_dataset(**hf_dataset); synthetic: a generated Markov chain over bytes (synthetic_tokens)
    name: Literal["stdlib-source", "text", "synthetic", "jsonl", "parquet", "hf"] = "stdlib-source"
    seq_len: int = field(default=128, metadata=_rng(1, 1 << 24))  # tokens per training sequence
    batch_size: int = field(default=8, metadata=_rng(1, 1 << 20))  # per-rank micro-batch
    paths: list[str] = field(default_factory=list)  # files or globs for name: text, jsonl, parquet, hf
    # documents held out for validation (every k-th one, so both splits sample the whole corpus)
    val_fraction: float = field(default=0.05, metadata=_rng(0.0, 0.5))
    max_bytes: int = field(default=0, metadata=_rng(0, 1 << 50))  # 0: no cap on the corpus size
    synthetic_tokens: int = field(default=200_000, metadata=_rng(1, 1 << 40))  # name synthetic: its length
    # jsonl: the longest line read (a longer one is a bad record, see bad_records), so one huge line cannot
    # take the host's memory
    max_line_bytes: int = field(default=16 << 20, metadata=_rng(1024, 1 << 34))
    # a record that cannot be read (an overlong or not-JSON line, invalid UTF-8 for a tokenizer that decodes
    # text, a missing field, a malformed conversation): error stops before any rank starts, naming it; skip
    # leaves it out and reports the count and the first; auto is error for pretraining text, skip for
    # chat/instruction records
    bad_records: Literal["auto", "error", "skip"] = "auto"
    text_field: str = "text"  # jsonl, parquet, hf: the field (column) holding each document's text
    tokenizer: str = "bytes"  # bytes, a local Hugging Face tokenizer folder, or a Hub id (owner/name)
    tokenizer_revision: str | None = None  # a Hub tokenizer's revision; pinned to a commit as model.revision
    hf_dataset: dict = field(default_factory=dict)  # name hf: keyword arguments of datasets.load_dataset
    cache_dir: str | None = None  # tokenized corpora; default $ZOFF_CACHE_DIR or ~/.cache/zoff
    # text: documents for pretraining (every token in the loss); chat: a list of {role, content} messages per
    # record, rendered by the tokenizer's chat template; instruction: a prompt and a response field per record
    format: Literal["text", "chat", "instruction"] = "text"
    messages_field: str = "messages"  # chat: the field holding each record's messages
    prompt_field: str = "prompt"  # instruction: the field holding each record's prompt
    response_field: str = "response"  # instruction: the field holding each record's answer
    train_on_prompt: bool = False  # chat/instruction: false puts only the answers' tokens in the loss
    overlong: Literal["truncate", "drop"] = "truncate"  # chat/instruction: examples longer than seq_len
    # chat/instruction: several examples share one sequence, each attending only to itself (positions restart);
    # auto packs where the model supports per-example attention (the builtin GPT, transformers models that
    # mask by position_ids: tried on a tiny twin of the model, models/packing.py), always refuses a model that
    # does not
    packing: Literal["auto", "always", "never"] = "auto"


@dataclass(frozen=True)
class IoConfig:
    """The disk tier's I/O (engine/disk/swapfile.py): parallel O_DIRECT requests of request_mb each."""

    threads: int = field(default=4, metadata=_rng(1, 64))  # requests in flight per swap file
    request_mb: int = field(default=8, metadata=_rng(1, 1024))  # the size of one request


@dataclass(frozen=True)
class OptimizerIoConfig(IoConfig):
    """The optimizer's disk I/O, plus the size of the sub-groups it steps its shard in."""

    # the optimizer steps its shard in sub-groups of at most this much state (master + moments): RAM holds
    # five of them (stepped, read ahead, written back), whatever the size of a unit
    subgroup_mb: int = field(default=96, metadata=_rng(1, 1 << 20))


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where the optimizer's fp32 master and Adam moments live (and the CPU Adam steps them): on the device
    (none), in host memory (cpu), or in swap files on a local disk (nvme)."""

    device: Literal["none", "cpu", "nvme"] = "none"  # none: on the device, beside the parameters
    # nvme: the directory of the swap files (a local disk; a per-rank folder is made under it)
    nvme_path: str | None = None
    # a swap folder others can write (and not sticky, as /tmp is) lets them swap the rank folders for their
    # own: refused unless this says the folder is yours to share (both nvme_paths)
    allow_shared_path: bool = False
    io: OptimizerIoConfig = field(default_factory=OptimizerIoConfig)
    pin_memory: bool = True  # page-lock the staging buffers (GPU only): DMA at full speed, async with compute
    # Gradient shards go down and parameter shards up through this many MiB of staging buffers per rank; the
    # fp32 master and moments stay pageable (pinning them would lock 12 B/param/N of host memory).
    staging_mb: int = field(default=64, metadata=_rng(1, 1 << 20))
    # Where the reduced gradient shard lives (it leaves the device as each reduction finishes): auto is the
    # optimizer's own tier (cpu: host memory; nvme: a gradient swap file, so RAM stays bounded by buffers,
    # at 2 B/param/N more disk traffic each way per micro-batch, 4 when accumulating); cpu keeps it in host
    # memory beside disk-tier states (less disk traffic, RAM grows with the model). Under delay_update the
    # delayed step reads the shard while the next backward writes the next one: on disk, two gradient files;
    # in RAM, the shard and a snapshot of it (in fp32 when clipping or fp16 rescales it).
    grad_device: Literal["auto", "cpu", "nvme"] = "auto"
    # nvme: the host memory (per rank) the disk tier may use, so that the disk holds only what RAM cannot: whole
    # units' sub-groups, spread over the step, stay in RAM and are never read or written (nor, parameters on
    # disk, their shards), the rest stream through a ring of five sub-group buffers; with grad_device auto the
    # gradient shard stays in RAM too when every state does.
    # auto: this host's MemTotal less max(2 GiB + 0.75 GiB per local rank, 12.5%) (the OS, the interpreters),
    # split evenly over the node's ranks; min: only the ring and the gradient buffers (everything on disk); or
    # a size (e.g. 8GiB), which must hold at least that minimum. Placement only: the numbers are the same.
    host_budget: str = "auto"
    # Stage 3 with the optimizer offloaded (zero3-offload, zero3-nvme-opt, zero3-nvme): the optimizer walks its
    # shard in a background thread while the next forward runs, which waits for each block's update before
    # gathering it (the walk goes in the forward's order). The same update, in the same order per element: the
    # numbers are unchanged (DPU's are not); the step's disk I/O, and on a GPU host the CPU Adam, then overlap
    # the forward instead of following backward. Costs the forward cores that the CPU Adam shares on a host
    # without a GPU.
    overlap_step: bool = False
    # Exact speculation (issue 53): during the last micro-batch's backward, a worker computes each unit's update
    # as its gradient lands, with the clipping factor 1 and the coming lr, into second places (a second slot
    # per piece on disk, second buffers in RAM); after backward it is committed where the factor really is 1,
    # nothing overflowed and no late gradient touched the unit, else discarded and walked as usual: the same
    # bits either way. auto: speculate a step when the last one did not clip (so a run that clips every step
    # pays nothing), on the disk tier, and on the host tier when backward runs on a GPU (on a host-only machine
    # the CPU Adam would take backward's own cores); true: always; false: never. Costs the second slots' disk
    # bytes (what the disk's free room allows) and, on the host tier, 12 B/param/N of RAM.
    speculate: Literal["auto", True, False] = "auto"
    delay_update: bool = False  # ZeRO-Offload's delayed parameter update: params one step stale
    delay_update_warmup: int = field(default=0, metadata=_rng(0, 1 << 40))  # delay_update: exact steps first

    @property
    def grads_on_disk(self) -> bool:
        """The disk tier may keep the gradient shard in its own swap file (two under delay_update: the delayed
        step reads one while the next backward writes the other): grad_device nvme, or auto, where the host
        budget keeps it in RAM only when it holds every state too (host_budget.disk_split)."""
        return self.device == "nvme" and self.grad_device != "cpu"


@dataclass(frozen=True)
class OffloadParamConfig:
    device: Literal["none", "cpu", "nvme"] = "none"  # nvme: stage 3's parameter shards in a swap file
    # nvme: the directory of the parameter swap files; unset: offload_optimizer.nvme_path (one folder for both)
    nvme_path: str | None = None
    io: IoConfig = field(default_factory=IoConfig)
    pin_memory: bool = True  # cpu: page-lock the parameter shards (GPU only): uploads async with compute


@dataclass(frozen=True)
class ZeroConfig:
    recipe: str | None = None  # the preset this section was built from, kept for the record
    auto: bool = False  # `zero: auto`: zoff train picks the fastest policy that fits (zoff.planning.estimate)
    # 0: data parallel; 1: optimizer states partitioned; 2: and gradients; 3: and parameters (gathered per block)
    stage: int = field(default=0, metadata=_rng(0, 3))
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    overlap_comm: bool = True  # reduce gradients in the background while backward goes on
    # Sizes are in elements, as in the ZeRO papers; a bucket holds one dtype.
    # Stages 2/3 keep MAX_IN_FLIGHT + 1 pooled buckets of up to this size for the whole run: 25M fp32
    # elements would hold 300 MB per rank; 5M holds 60 MB and measured no slower over gloo.
    reduce_bucket_size: int = field(default=5_000_000, metadata=_rng(1, 1 << 40))
    # Accepted for DeepSpeed configs but not used: parameters are all-gathered per unit, as the gradients
    # were reduced (reduce_bucket_size), straight from each rank's shard with no staging bucket.
    allgather_bucket_size: int = field(default=25_000_000, metadata=_rng(1, 1 << 40))
    # Stage 3 gathers up to this many elements ahead of need. 3M rather than 5M: no slower over gloo here
    # (per-round ratio 1.01, 57M GPT) and 16 MB less per rank in fp32; GPUs with NCCL may want more.
    prefetch_bucket_size: int = field(default=3_000_000, metadata=_rng(0, 1 << 40))
    # stage 3: parameters this small (norms, biases) stay whole on every rank rather than gathered per use
    param_persistence_threshold: int = field(default=10_000, metadata=_rng(0, 1 << 40))
    # Stage 3 gathers each block whole (its units together): by default the repeated layers (and HF's _no_split_modules). Module
    # classes named here are blocks too, gathered whole whenever they run: name the layer that holds
    # data-dependent parts (a MoE layer whose experts some rank's tokens skip) so every rank gathers them.
    # Classes of parts inside the layers gather the layers part by part, for layers too big to hold twice
    # ([CausalSelfAttention, MLP], or [Linear] for each linear alone); `zoff estimate` and `zero: auto` choose
    # that by themselves where whole layers do not fit.
    block_classes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "adam"] = (
        "adamw"  # adamw: decoupled weight decay; adam: decay added to the gradient
    )
    lr: float = field(default=3e-4, metadata=_rng(0.0, gt=True))  # the peak, reached after warmup
    betas: tuple[float, float] = (0.9, 0.95)  # each in [0, 1)
    eps: float = field(default=1e-8, metadata=_rng(0.0, gt=True))  # added to the root of the second moment
    # applied to matrices and embeddings, not to biases and norm gains
    weight_decay: float = field(default=0.1, metadata=_rng(0.0))


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_steps: int = field(default=20, metadata=_rng(0, 1 << 40))  # linear from 0 to optim.lr
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # from optim.lr to the end of max_steps
    min_lr_ratio: float = field(default=0.1, metadata=_rng(0.0, 1.0))  # where the decay ends, x optim.lr


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = field(default=200, metadata=_rng(1, 1 << 40))  # optimizer steps
    grad_accum: int = field(default=1, metadata=_rng(1, 1 << 20))  # micro-batches per step on each rank
    # sequences per step over all ranks: when set, grad_accum is derived from it and the world size
    global_batch_size: int | None = field(default=None, metadata=_rng(1, 1 << 20))
    grad_clip: float = field(default=1.0, metadata=_rng(0.0))  # 0 disables clipping
    # A step whose loss or gradients are non-finite on any rank is skipped on every rank (nothing of it is
    # applied) and said in one line; this many in a row stop the run (exit 1), naming the last checkpoint.
    # fp16's overflows are skipped and counted alike, but count toward it only at the loss scale's floor of 1.
    max_nonfinite_steps: int = field(default=5, metadata=_rng(1, 1 << 20))
    # bf16/fp16: compute in that dtype over an fp32 master; fp16 scales the loss dynamically
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # what a rank that computes on the CPU does where this host has no fast matmul kernel for a 16-bit
    # `precision` (bf16/fp16 without AVX512: ~100x slower than fp32; zoff.host.kernels measures it): native
    # computes as configured (the plan says how much slower); fp32 computes in fp32 on every CPU host (the
    # same numbers on every host kind); auto computes in fp32 only where the 16-bit kernel is slow, and says
    # so in the plan. fp32 changes the numbers (fp32's, not bf16's) and keeps the model states' 16 B/param.
    # upcast computes in fp32 over the configured 16-bit storage: parameters, gradients, their files and
    # every memory figure but the activations stay 16-bit (zoff/models/upcast.py; its own numbers: fp32
    # products of 16-bit weights). A GPU rank ignores it.
    cpu_precision: Literal["native", "fp32", "upcast", "auto"] = "native"
    seed: int = field(default=0, metadata=_rng(0, (1 << 63) - 1))  # the init and the data order
    log_every: int = field(default=10, metadata=_rng(1, 1 << 40))  # steps between metrics lines
    eval_every: int = field(default=0, metadata=_rng(0, 1 << 40))  # 0: only at the end
    eval_batches: int = field(default=4, metadata=_rng(1, 1 << 20))  # global batches of the val split
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # with activation_checkpointing: each block's kept input goes to host memory (page-locked on a GPU) as the
    # block runs and comes back one block ahead in backward; results unchanged. Costs two copies of
    # tokens x d_model per block and step over the host link, overlapped with compute on a side stream.
    activation_offload: bool = False
    # the output head and the cross-entropy a tile of this many positions at a time, each recomputed in
    # backward: no (tokens x vocabulary) logits tensor exists (32000 x 16K tokens = 2 GiB in fp32); 0: untiled.
    # Costs one more head matmul per tile in backward.
    loss_tile: int = field(default=0, metadata=_rng(0, 1 << 24))
    # each block's MLP a tile of this many tokens at a time, each tile recomputed in backward: its wide
    # intermediates (8 x d_model per token in the builtin GPT) exist one tile at a time; 0: untiled. Costs the
    # MLP's forward once more per step.
    mlp_tile: int = field(default=0, metadata=_rng(0, 1 << 24))
    # torch.compile each repeated block (the blocks stage 3 gathers: a ModuleList's layers, HF decoder layers,
    # zero.block_classes) on its own, regional compilation as torchtitan does: the engine's hooks stay eager
    # around them. Costs the first step its compile time (tens of seconds per block class on a CPU).
    compile: bool = False
    # torch.compile's backend: inductor generates kernels; aot_eager traces and runs torch's own ops (no
    # speed-up: to tell a compile problem from a kernel one)
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # Ulysses sequence parallelism: each group of this many ranks trains the same sequences, each rank holding
    # 1/N of their tokens; around attention an all-to-all gives each rank every token of 1/N of the heads
    # (zoff/models/ulysses.py). N divides the world size, the heads (key/value heads: or N divides them) and
    # data.seq_len. The global batch stays in sequences; each rank sees data.seq_len / N tokens of each. Costs
    # two all-to-alls per layer and pass, each ~(q + k + v, or the output) x seq_len x width / N elements a rank.
    sequence_parallel: int = field(default=1, metadata=_rng(1, 1024))


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # default: <run_dir>/checkpoints
    every_steps: int = field(default=0, metadata=_rng(0, 1 << 40))  # 0: only at the end
    keep_last: int = field(default=2, metadata=_rng(1, 1 << 20))  # older steps are deleted
    # false: never save, not even at the end or on preemption (a run whose disk has no room for a copy of its
    # states); resuming from an existing checkpoint still works
    enabled: bool = True


@dataclass(frozen=True)
class LaunchConfig:
    nproc_per_node: int = field(default=2, metadata=_rng(1, 1024))  # ranks on this node
    nnodes: str = "1"  # N or MIN:MAX
    node_rank: int = field(
        default=0, metadata=_rng(0, 1 << 20)
    )  # accepted as torchrun's; the c10d rendezvous orders the nodes itself
    rdzv_endpoint: str | None = (
        None  # HOST:PORT; None runs a standalone rendezvous on this node (loopback only)
    )
    # across nodes: the network interface (e.g. eth1) whose IPv4 address rank 0's store and the ranks'
    # gloo/NCCL sockets bind; None: the one routed to rdzv_endpoint. A single node always uses loopback.
    interface: str | None = None
    max_restarts: int = field(default=0, metadata=_rng(0, 1 << 20))  # restarts from the last checkpoint
    threads_per_rank: int | None = field(default=None, metadata=_rng(1, 4096))  # None: cores / local ranks
    timeout_s: float = field(
        default=600.0, metadata=_rng(1.0, 1e7)
    )  # a collective waiting longer is an error
    shutdown_timeout_s: int = field(
        default=300, metadata=_rng(1, 10_000_000)
    )  # preempted ranks' time to checkpoint
    # Elastic rendezvous (torch's c10d last_call_timeout and keep_alive_interval): once MIN nodes of MIN:MAX
    # have joined, how long to wait for more before starting; and how often each node proves it is alive (a
    # node silent for 3 intervals is dead, and the others re-form without it). Shorter: a shrinking restart
    # starts sooner; cost: nodes that join late miss the round, and more heartbeats hit the store.
    rdzv_last_call_s: int = field(default=30, metadata=_rng(1, 1 << 20))
    rdzv_keep_alive_s: int = field(default=5, metadata=_rng(1, 1 << 20))  # see rdzv_last_call_s

    @property
    def min_nodes(self) -> int:
        """The fewest nodes (MIN of MIN:MAX): the fewest ranks, which need the most memory and disk each."""
        return int(self.nnodes.split(":")[0])

    @property
    def min_world(self) -> int:
        return self.nproc_per_node * self.min_nodes


@dataclass(frozen=True)
class LogConfig:
    run_dir: str | None = None  # default: runs/<config name>-<timestamp>
    progress: bool = True  # a live progress bar on rank 0 (plain lines when not a terminal)
    tensorboard: bool = False  # also write the metrics as TensorBoard scalars under <run_dir>/tensorboard
    # also log to Weights & Biases (zoff[wandb]; WANDB_MODE=offline to keep it local) and to MLflow
    # (zoff[mlflow]; MLFLOW_TRACKING_URI): the config, every metric, the plan's memory; a restart continues
    # the same tracker run (its id is kept in <run_dir>/trackers.json)
    wandb: bool = False
    mlflow: bool = False  # see wandb: MLflow, the same figures
    project: str = "zoff"  # the W&B project and the MLflow experiment
    run_name: str | None = None  # the trackers' run name; default: the run directory's name


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return to_dict(self)
