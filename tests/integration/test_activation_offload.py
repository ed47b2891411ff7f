"""train.activation_offload: the checkpointed blocks' inputs live in host memory between forward and backward,
and nothing else changes: losses, gradients and weights are bit for bit those of checkpointing alone.

On this CPU-only machine the "device" is the host, so the copies go from one host tensor to another; the
mechanism (handles in place of the inputs, the recompute on a fetched copy, the copies freed as they are
made, the next block's input fetched ahead) is the same code a GPU runs (its CUDA path:
tests/gpu/test_cuda_paths.py).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import weakref

import pytest
import torch

from tests.datafiles import chat_llama_files
from tests.harness import run_zoff_many, tiny_cfg
from zoff.config import ConfigError, ModelConfig, config_from_dict, load_config
from zoff.models import enable_activation_checkpointing, lm_loss
from zoff.models.gpt import GPT
from zoff.planning.activations import gpt_activations
from zoff.planning.memory import activation_offload_budget
from zoff.trainer.activation_offload import ActivationOffload, HostSaved
from zoff.units import human

pytestmark = pytest.mark.slow


def _steps(
    model, offload: ActivationOffload | None, x, y, steps: int = 2
) -> tuple[list[float], torch.Tensor]:
    enable_activation_checkpointing(model, offload.checkpoint if offload else None)
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
    return losses, torch.cat([p.grad.flatten() for p in model.parameters()])


def test_gpt_with_offloaded_inputs_equals_checkpointing_alone_and_frees_them(monkeypatch) -> None:
    """Bitwise the same losses and gradients; after the forward every block input has been freed (only its host
    copy remains) and the host holds exactly the estimate's bytes; after backward it holds none."""
    torch.manual_seed(0)
    base = GPT(3, 2, 32, 256, 16, dropout=0.1)  # dropout: the recompute must replay the same masks too
    x, y = torch.randint(256, (2, 2, 16))
    torch.manual_seed(1)
    want = _steps(copy.deepcopy(base), None, x, y)
    torch.manual_seed(1)
    offload = ActivationOffload(torch.device("cpu"))
    freed: list[weakref.ref] = []
    store = HostSaved.store

    def watched(self: HostSaved) -> None:
        freed.append(weakref.ref(self.device_x))
        store(self)

    monkeypatch.setattr(HostSaved, "store", watched)
    model = copy.deepcopy(base)
    enable_activation_checkpointing(model, offload.checkpoint)
    out = model(x)
    assert len(freed) == 3 and all(r() is None for r in freed)  # no block input is still held on the "device"
    m = ModelConfig(name="gpt", n_layer=3, n_head=2, d_model=32, vocab_size=256, seq_len=16)
    assert offload.stored_bytes == gpt_activations(m, 2, 16, "fp32", True, "cpu", offload=True).host
    lm_loss(out, y).backward()
    assert offload.stored_bytes == 0
    torch.manual_seed(1)
    got = _steps(copy.deepcopy(base), ActivationOffload(torch.device("cpu")), x, y)
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_each_input_of_a_call_has_its_own_slot_and_an_in_place_change_is_refused() -> None:
    """Two inputs of one checkpointed call are two handles, fetched in order; a block that changes its own
    input in place fails with one line instead of recomputing from the changed values."""
    offload = ActivationOffload(torch.device("cpu"))
    a, b = (torch.randn(4, 3, requires_grad=True) for _ in range(2))
    out = offload.checkpoint(lambda x, y: (x * y).sum(), a * 1, b * 1)
    assert [h.index for h in offload.saved] == [0, 1]
    out.backward()
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())

    def in_place(x):
        x.mul_(2)
        return x.sum()

    with pytest.raises(RuntimeError, match="changed its input in place"):
        ActivationOffload(torch.device("cpu")).checkpoint(in_place, torch.randn(3, requires_grad=True) * 1)


def test_the_estimate_moves_the_inputs_to_the_host() -> None:
    m = ModelConfig(name="gpt", n_layer=8, n_head=4, d_model=256, vocab_size=1000, seq_len=512)
    plain = gpt_activations(m, 2, 512, "bf16", True, "cuda", loss_tile=256)
    moved = gpt_activations(m, 2, 512, "bf16", True, "cuda", loss_tile=256, offload=True)
    inputs = 8 * 2 * 512 * 256 * 2
    assert moved.host == inputs and plain.host == 0
    assert plain.saved - moved.saved == inputs
    assert gpt_activations(m, 2, 512, "bf16", False, "cuda", offload=True).host == 0  # needs checkpointing


def test_offload_without_checkpointing_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"train\.activation_offload: .* needs train\.activation_checkpointing: true"
    ):
        config_from_dict(tiny_cfg(train={"activation_offload": True}))


@pytest.mark.parametrize(
    "zero",
    [{"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, {"stage": 2}],
    ids=["zero3-offload", "zero2"],
)
def test_engine_runs_equal_checkpointing_alone_on_two_ranks(zero: dict) -> None:
    """Through the engine and its hooks (stage 3 gathers each block for the recompute from the fetched input)."""
    zero = {**zero, "param_persistence_threshold": 64}
    train = {"max_steps": 4, "activation_checkpointing": True}
    cfgs = [
        tiny_cfg(zero=zero, train=train),
        tiny_cfg(zero=zero, train={**train, "activation_offload": True}),
    ]
    plain, offloaded = run_zoff_many(cfgs, 2)
    assert offloaded["losses"] == plain["losses"]
    for k, v in plain["params"].items():
        assert torch.equal(offloaded["params"][k], v), k


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return chat_llama_files(tmp_path_factory.mktemp("act-offload"), 32)


def test_hugging_face_layers_run_through_the_offloading_checkpoint(llama) -> None:
    """A transformers Llama: its layers' own checkpoint function replaced; gradients bitwise those without."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(llama["llama"]).train()
    x = torch.randint(100, (2, 32))
    got = {}
    for off in (False, True):
        model = copy.deepcopy(base)
        offload = ActivationOffload(torch.device("cpu")) if off else None
        got[off] = _steps(model, offload, x, x, steps=1)
        if off:
            assert offload.peak_stored_bytes == 2 * 2 * 32 * 32 * 4  # 2 layers x (batch x seq x hidden) fp32
    assert got[True][0] == got[False][0] and torch.equal(got[True][1], got[False][1])


def test_a_forward_that_raised_gives_its_host_copies_back() -> None:
    """At 51a0203 a forward that raised left its handles listed and their host buffers held: the list grew by
    each such forward's blocks (7, 11, 15, ...). A handle now lives with its graph: once the raised forward's
    graph is gone, its copies are back in the pool, and the next forward starts a fresh list."""
    torch.manual_seed(0)
    model = GPT(4, 2, 32, 256, 16)
    offload = ActivationOffload(torch.device("cpu"))
    enable_activation_checkpointing(model, offload.checkpoint)
    x, y = torch.randint(256, (2, 2, 16))
    last, failing = model.blocks[-1], [False]
    forward = last.forward

    def fails_when_asked(*args, **kwargs):
        if failing[0]:
            raise RuntimeError("a bad batch")
        return forward(*args, **kwargs)

    last.forward = fails_when_asked
    for _ in range(4):
        failing[0] = True
        with pytest.raises(RuntimeError, match="a bad batch"):
            model(x)
        assert offload.stored_bytes == 0 and offload.saved == []  # the 3 blocks before it: given back
        failing[0] = False
        out = model(x)
        assert len(offload.saved) == 4
        lm_loss(out, y).backward()
        assert offload.stored_bytes == 0
    assert offload.pool.held_bytes == offload.peak_stored_bytes  # one forward's buffers, reused


def test_the_pool_keeps_to_the_plans_budget_and_says_once_when_a_forward_needs_more(capsys) -> None:
    """At 51a0203 the pool had no budget: every size it ever served stayed held (a shorter sequence's
    forward added its own buffers beside the longer one's), and nothing said when the host held more than the
    estimate counted. Now its budget is the estimate's bytes: free buffers of another size go back first, and
    a forward over the budget is one warning, once."""
    torch.manual_seed(0)
    model = GPT(3, 2, 32, 256, 16)
    m = ModelConfig(name="gpt", n_layer=3, n_head=2, d_model=32, vocab_size=256, seq_len=16)
    budget = gpt_activations(m, 2, 16, "fp32", True, "cpu", offload=True).host
    offload = ActivationOffload(torch.device("cpu"), budget)
    enable_activation_checkpointing(model, offload.checkpoint)
    for seq in (16, 8, 16, 12):
        x, y = torch.randint(256, (2, 2, seq))
        lm_loss(model(x), y).backward()
        assert offload.pool.held_bytes <= budget, seq
    assert offload.peak_stored_bytes == budget and capsys.readouterr().err == ""
    x, y = torch.randint(256, (2, 3, 16))  # a larger micro-batch than planned
    for _ in range(2):
        lm_loss(model(x), y).backward()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "zoff: warning: train.activation_offload holds 18.0 KiB of block inputs in host memory, more than the "
        "plan's 12.0 KiB per rank (zoff estimate's); the host needs the difference too"
    ]


def test_a_run_plans_the_budget_the_estimate_counts(tmp_path) -> None:
    """The start-up plan's line, the estimate's note and the pool's budget: one number, from the same function
    (planning.memory.activation_offload_budget); a run that keeps to it prints no warning."""
    args = ["configs/tiny.yaml", "train.activation_checkpointing=true", "train.activation_offload=true"]
    want = human(activation_offload_budget(load_config(args[0], args[1:]), "cpu"))
    run = _zoff("train", *args, "train.max_steps=2", "--run-dir", str(tmp_path / "r"))
    est = _zoff("estimate", *args, "--gpus-per-node", "2", "--gpu-memory", "24GiB")
    assert f"activation offload: the blocks' inputs in host memory, {want} per rank (budget)" in run.stdout
    assert f"train.activation_offload: the blocks' inputs take {want} of host memory per rank" in est.stdout
    assert "warning: train.activation_offload" not in run.stdout + run.stderr


def _zoff(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "zoff", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out
