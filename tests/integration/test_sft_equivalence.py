"""Fine-tuning on chat data equals plain PyTorch: a transformers Llama read from a folder, the loss on the
assistant's tokens only, examples packed several to a sequence, at ZeRO stages 0-3 on 1-3 ranks with
accumulation, within 1e-5 in fp32.

The reference shares nothing with zoff's data path but the choice of which examples make each step's global
batch: it renders each conversation with transformers' own `apply_chat_template(...,
return_assistant_tokens_mask=True)` (a template with {% generation %} marks; zoff masks by rendering prefixes
instead), runs every example *alone* through the model (no packing, no position_ids: so zoff's packed
sequences must keep examples apart to agree), sums the cross-entropy of the answer tokens over the global
batch, divides by their count, and steps torch.optim.AdamW.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.datafiles import CONVERSATIONS, chat_llama_files
from tests.harness import assert_close_losses, assert_close_params, plain_optimizer, run_zoff_many, tiny_cfg
from zoff.config import config_from_dict
from zoff.data.sft import SFTBatches, load_sft_corpus
from zoff.trainer.schedule import lr_at
from zoff.trainer.session import build_session

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS = 4
SEQ = 128  # every conversation fits: the reference does not truncate
GLOBAL = 12  # sequences per step: 3 x 4 x 1, 3 x 2 x 2, 2 x 2 x 3 (micro-batch x accumulation x ranks)
# (world, stage, micro-batch, accumulation); world 3 runs with `-m grid` (the default suite's time budget)
CELLS = [(1, 0, 3, 4), (2, 0, 3, 2), (2, 1, 3, 2), (2, 2, 3, 2), (2, 3, 3, 2), (3, 2, 2, 2), (3, 3, 2, 2)]
GRID_WORLDS = {3}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    return chat_llama_files(tmp_path_factory.mktemp("sft"), SEQ)


def _cfg(files: dict, world: int, stage: int, micro: int, accum: int) -> dict:
    return tiny_cfg(
        model={"name": "hf:LlamaForCausalLM", "path": files["llama"], "seq_len": SEQ},
        data={
            "name": "jsonl", "paths": [files["data"]], "format": "chat", "tokenizer": files["tok"],
            "seq_len": SEQ, "batch_size": micro, "val_fraction": 0.1, "packing": "always",
        },
        zero={"stage": stage, "param_persistence_threshold": 64},
        train={"max_steps": STEPS, "grad_accum": accum, "grad_clip": 1.0},
        optim={"lr": 3e-3, "weight_decay": 0.1},
    )  # fmt: skip


def _examples(row_inputs: torch.Tensor, row_positions: torch.Tensor) -> list[tuple[int, ...]]:
    """The token ids of each example packed into a row (a new example where the position restarts)."""
    starts = [j for j in range(len(row_positions)) if row_positions[j] == 0] + [len(row_positions)]
    return [tuple(row_inputs[a:b].tolist()) for a, b in zip(starts, starts[1:])]


def reference(files: dict) -> dict:
    """Plain PyTorch over the same global batches: each example alone, the answers' tokens in the loss."""
    cfg = config_from_dict(_cfg(files, 1, 0, GLOBAL, 1))
    tok = transformers.AutoTokenizer.from_pretrained(files["tok"])
    by_inputs = {}  # an example's input ids -> (its input ids, targets with -100 outside the answers)
    for conv in CONVERSATIONS:
        out = tok.apply_chat_template(conv, return_assistant_tokens_mask=True, return_dict=True)
        ids, mask = out["input_ids"], out["assistant_masks"]
        targets = [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
        by_inputs[tuple(ids[:-1])] = (torch.tensor([ids[:-1]]), torch.tensor(targets))
    model = transformers.LlamaForCausalLM.from_pretrained(files["llama"], dtype=torch.float32)
    model.train()
    o = cfg.optim
    opt = plain_optimizer(model, o)
    corpus = load_sft_corpus(cfg.data, cfg.train.seed, pack=True)
    batches = SFTBatches(corpus, SEQ, GLOBAL, 1, 0, 1, cfg.train.seed)
    losses, norms, trained = [], [], []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o.lr, STEPS, cfg.schedule)
        opt.zero_grad()
        b = batches.micro_batch_at(step, 0)
        examples = [e for x, p in zip(b.inputs, b.position_ids) for e in _examples(x, p) if e in by_inputs]
        count = sum(int((by_inputs[e][1] != -100).sum()) for e in examples)
        total = sum(
            F.cross_entropy(model(x, use_cache=False).logits[0], y, ignore_index=-100, reduction="sum")
            for x, y in (by_inputs[e] for e in examples)
        )
        loss = total / count
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)))
        opt.step()
        losses.append(loss.item())
        trained.append(count)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params, "trained": trained}


@pytest.fixture(scope="module")
def ref(files) -> dict:
    return reference(files)


@pytest.fixture(scope="module")
def runs(files):
    """cell -> rank 0's result; each world size's cells run in one spawn, the first time one is asked for."""
    out: dict = {}

    def get(cell: tuple[int, int, int, int]) -> dict:
        if cell not in out:
            cells = [c for c in CELLS if c[0] == cell[0]]
            out.update(zip(cells, run_zoff_many([_cfg(files, *c) for c in cells], cell[0]), strict=True))
        return out[cell]

    return get


def test_every_packed_example_is_a_known_conversation(files, ref) -> None:
    """The reference found every example of every step (else it would compare less than zoff trains)."""
    cfg = config_from_dict(_cfg(files, 1, 0, GLOBAL, 1))
    corpus = load_sft_corpus(cfg.data, cfg.train.seed, pack=True)
    assert corpus.stats["truncated"] == corpus.stats["dropped"] == 0
    b = SFTBatches(corpus, SEQ, GLOBAL, 1, 0, 1, cfg.train.seed).micro_batch_at(0, 0)
    assert b.loss_divisor == ref["trained"][0] > 0
    assert all(len(e) for x, p in zip(b.inputs, b.position_ids) for e in _examples(x, p))


@pytest.mark.parametrize(
    "cell",
    [pytest.param(c, marks=pytest.mark.grid) if c[0] in GRID_WORLDS else c for c in CELLS],
    ids=lambda c: f"world{c[0]}-stage{c[1]}-mb{c[2]}x{c[3]}",
)
def test_sft_matches_plain_pytorch(runs, ref, cell) -> None:
    got = runs(cell)
    assert_close_losses(got["losses"], ref["losses"])
    assert_close_losses(got["grad_norms"], ref["grad_norms"])
    assert_close_params(got["params"], ref["params"])
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_packed_examples_do_not_see_each_other(files, model: str) -> None:
    """Change one example of a packed row: the logits of every other example in the row stay as they were."""
    cfg = _cfg(files, 1, 0, 2, 1)
    if model == "gpt":
        cfg["model"] = {
            "name": "gpt",
            "n_layer": 2,
            "n_head": 2,
            "d_model": 32,
            "seq_len": SEQ,
            "vocab_size": 512,
        }
    s = build_session(config_from_dict(cfg), torch.device("cpu"))
    b = s.batches.micro_batch_at(0, 0)
    row = next(i for i in range(len(b.inputs)) if int((b.position_ids[i] == 0).sum()) >= 3)
    x, pos = b.inputs[row : row + 1], b.position_ids[row : row + 1]
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [SEQ]
    a, z = starts[1], starts[2]  # the second example of the row
    changed = x.clone()
    changed[0, a:z] = (changed[0, a:z] + 7) % 300
    s.engine.model.eval()
    with torch.no_grad():
        before = getattr(s.engine.model(x, position_ids=pos), "logits", None)
        before = before if before is not None else s.engine.model(x, position_ids=pos)
        after = s.engine.model(changed, position_ids=pos)
        after = getattr(after, "logits", after)
    others = torch.ones(SEQ, dtype=torch.bool)
    others[a:z] = False
    assert torch.equal(before[0, others], after[0, others])
    assert not torch.allclose(before[0, a:z], after[0, a:z])
