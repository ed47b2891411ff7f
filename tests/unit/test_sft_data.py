"""Fine-tuning data (zoff.data.sft): chat/instruction records, the answer-only loss mask, overlong examples,
bad records, packing, the validation split, sources, and the sampler's loss normalisation."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.datafiles import CHATML, CONVERSATIONS, make_tokenizer, save_tokenizer
from zoff.config import config_from_dict
from zoff.data.batch import IGNORE
from zoff.data.sft import SFTBatches, SFTCorpus, SFTSplit, load_sft_corpus
from zoff.errors import UserError
from zoff.trainer.loss import micro_batch_loss

pytest.importorskip("transformers")

# Drops earlier answers' text, as templates that strip past reasoning do: no rendering extends the previous one.
FORGETFUL = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A bare "A" opens the answer: an answer starting with letters merges with it into one token.
MERGING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'A' + m['content'] + '\n' }}"
    "{% else %}{{ 'Q ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A' }}{% endif %}"
)


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 3 + ["Anything anything"] * 20
    base = make_tokenizer(root / "base", texts, vocab=320)
    return {
        "chat": save_tokenizer(base, root / "chat", CHATML),
        "plain": save_tokenizer(base, root / "plain", None),
        "forgetful": save_tokenizer(base, root / "forgetful", FORGETFUL),
        "merging": save_tokenizer(base, root / "merging", MERGING),
    }


def cfg_for(tmp_path: Path, **data):
    base = {"name": "jsonl", "seq_len": 64, "val_fraction": 0.0, "cache_dir": str(tmp_path / "cache")}
    merged = {**base, **data}
    return config_from_dict({"model": {"seq_len": merged["seq_len"]}, "data": merged}).data


def write_records(path: Path, records: list, raw_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in records]
    for at, text in (raw_lines or {}).items():
        lines.insert(at, text)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def load_quiet(cfg, pack: bool) -> SFTCorpus:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these fixtures have no bad record: a warning would be a failure
        return load_sft_corpus(cfg, 0, pack)


def rows(split: SFTSplit) -> list[tuple[list[int], list[int]]]:
    """Unpacked rows without their padding: (inputs, targets) of each example."""
    out = []
    for x, y in zip(split.input_ids.tolist(), split.targets.tolist()):
        n = max(j for j, t in enumerate(y) if t != IGNORE) + 1
        out.append((x[:n], y[:n]))
    return out


def segments(split: SFTSplit) -> list[tuple[list[int], list[int]]]:
    """Packed rows cut where the position ids restart: every example, and each row's padding tail."""
    out = []
    for x, y, p in zip(split.input_ids.tolist(), split.targets.tolist(), split.position_ids.tolist()):
        starts = [j for j, q in enumerate(p) if q == 0] + [len(p)]
        assert all(p[j] == p[j - 1] + 1 for j in range(1, len(p)) if j not in starts)
        out += [(x[a:b], y[a:b]) for a, b in zip(starts, starts[1:])]
    return out


# ------------------------------------------------------------------------------------------------ masks


def test_chat_mask_is_the_templates_generation_mask(tmp_path, toks):
    from transformers import AutoTokenizer

    f = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    c = load_quiet(
        cfg_for(tmp_path, paths=[str(f)], format="chat", tokenizer=str(toks["chat"]), seq_len=200), False
    )
    hf = AutoTokenizer.from_pretrained(str(toks["chat"]), local_files_only=True)
    assert len(c.train) == len(CONVERSATIONS)  # val_fraction 0: all train, one per row
    for conv, (x, y), full_x, full_y in zip(CONVERSATIONS, rows(c.train), c.train.input_ids, c.train.targets):
        ref = hf.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = ref["input_ids"], ref["assistant_masks"]
        assert x == ids[:-1]
        assert y == [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]
        assert full_y[len(ids) - 1 :].eq(IGNORE).all() and full_x[len(ids) - 1 :].eq(c.pad_id).all()
        assert sum(mask) > 0 and y[-1] == hf.convert_tokens_to_ids("\u010a")  # the turn's newline is trained
    assert c.train.trained.tolist() == [sum(t != IGNORE for t in y) for _, y in rows(c.train)]
    # the validation split reuses the last example when val_fraction is 0
    assert torch.equal(c.val.input_ids, c.train.input_ids[-1:]) and "reuses" in c.description


def test_chat_train_on_prompt_trains_every_token(tmp_path, toks):
    from transformers import AutoTokenizer

    f = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS[:6]])
    cfg = cfg_for(
        tmp_path,
        paths=[str(f)],
        format="chat",
        tokenizer=str(toks["chat"]),
        seq_len=200,
        train_on_prompt=True,
    )
    c = load_quiet(cfg, False)
    hf = AutoTokenizer.from_pretrained(str(toks["chat"]), local_files_only=True)
    for conv, (x, y) in zip(CONVERSATIONS, rows(c.train)):
        ids = hf(hf.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
        assert (x, y) == (ids[:-1], ids[1:])


def test_instruction_with_bytes_and_with_a_chat_template(tmp_path, toks):
    recs = [{"prompt": "ab", "response": "cd"}, {"prompt": "", "response": "xyz"}]
    f = write_records(tmp_path / "i.jsonl", recs)
    c = load_quiet(cfg_for(tmp_path, paths=[str(f)], format="instruction", seq_len=6), False)
    assert c.eos_id == 0 and c.pad_id == 0 and c.vocab_size == 256
    assert c.train.input_ids.tolist() == [[97, 98, 99, 100, 0, 0], [120, 121, 122, 0, 0, 0]]
    i = IGNORE
    assert c.train.targets.tolist() == [[i, 99, 100, 0, i, i], [121, 122, 0, i, i, i]]
    c = load_quiet(
        cfg_for(tmp_path, paths=[str(f)], format="instruction", seq_len=6, train_on_prompt=True), False
    )
    assert c.train.targets.tolist()[0] == [98, 99, 100, 0, i, i]
    # a tokenizer with a chat template renders the record as a user turn and an assistant turn
    ct = load_quiet(
        cfg_for(tmp_path, paths=[str(f)], format="instruction", tokenizer=str(toks["chat"])), False
    )
    g = tmp_path / "g.jsonl"
    turns = [
        [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]
        for r in recs
    ]
    write_records(g, [{"messages": t} for t in turns])
    cc = load_quiet(cfg_for(tmp_path, paths=[str(g)], format="chat", tokenizer=str(toks["chat"])), False)
    assert torch.equal(ct.train.input_ids, cc.train.input_ids) and torch.equal(
        ct.train.targets, cc.train.targets
    )


def test_tokenizers_without_a_chat_template_and_templates_that_rewrite_turns_are_refused(tmp_path, toks):
    f = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    for tok in ("bytes", str(toks["plain"])):
        with pytest.raises(UserError, match=r"data\.tokenizer: .*chat_template"):
            load_sft_corpus(cfg_for(tmp_path, paths=[str(f)], format="chat", tokenizer=tok), 0, True)
    # the second conversation has two answers: the forgetful template drops the first when rendering the next
    with pytest.raises(
        UserError, match=rf"data\.tokenizer: .*{re.escape(str(toks['forgetful']))}.*c\.jsonl:2"
    ):
        load_sft_corpus(
            cfg_for(tmp_path, paths=[str(f)], format="chat", tokenizer=str(toks["forgetful"])), 0, True
        )


def test_an_answer_whose_tokens_merge_with_the_turns_opening_is_skipped(tmp_path, toks):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(toks["merging"]), local_files_only=True)
    assert hf.tokenize("Anything")[0] != "A"  # the premise: "A" + "nything" is not "A" then "nything"
    turns = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": a}] for a in (" fine", "nything")
    ]
    f = write_records(tmp_path / "m.jsonl", [{"messages": t} for t in turns])
    with pytest.warns(UserWarning, match=r"skipped 1 of 2 .*m\.jsonl:2: its tokenization merges"):
        c = load_sft_corpus(
            cfg_for(tmp_path, paths=[str(f)], format="chat", tokenizer=str(toks["merging"])), 0, False
        )
    answer = hf("Q hi\nA fine\n", add_special_tokens=False)["input_ids"][len(hf("Q hi\nA")["input_ids"]) :]
    assert [t for t in c.train.targets[0].tolist() if t != IGNORE] == answer


# ---------------------------------------------------------------------------------- overlong, bad records


def test_overlong_examples_are_truncated_or_dropped(tmp_path):
    recs = [
        {"prompt": "p" * 4, "response": "r" * 4},  # 8 inputs: fits
        {"prompt": "p" * 4, "response": "r" * 20},  # 24 inputs: cut to 16, answer tokens remain
        {"prompt": "p" * 20, "response": "r" * 4},  # 24 inputs: the cut leaves only the prompt
        {"prompt": "p", "response": "r" * 15},  # 16 inputs: exactly fits
    ]
    f = write_records(tmp_path / "i.jsonl", recs)
    base = {"paths": [str(f)], "format": "instruction", "seq_len": 16}
    c = load_quiet(cfg_for(tmp_path, **base, overlong="truncate"), False)
    assert (c.stats["truncated"], c.stats["dropped"], c.stats["examples"]) == (1, 1, 3)
    assert "truncated 1, dropped 1" in c.description
    assert c.train.input_ids[1].tolist() == [ord("p")] * 4 + [ord("r")] * 12
    assert c.train.targets[1].tolist() == [IGNORE] * 3 + [ord("r")] * 13
    c = load_quiet(cfg_for(tmp_path, **base, overlong="drop"), False)
    assert (c.stats["truncated"], c.stats["dropped"], c.stats["examples"]) == (0, 2, 2)
    assert [x[0] for x in c.train.input_ids.tolist()] == [ord("p")] * 2 and c.train.trained.tolist() == [
        5,
        16,
    ]
    with pytest.raises(UserError, match=r"no usable instruction record.*longer than data\.seq_len 4"):
        load_sft_corpus(cfg_for(tmp_path, **{**base, "seq_len": 4}, overlong="drop"), 0, False)


def test_bad_records_are_skipped_with_one_warning_naming_the_first(tmp_path, toks):
    good = [{"messages": c} for c in CONVERSATIONS[:8]]
    bad = [
        {"messages": [{"role": "user", "content": "hi"}]},  # no answer
        {"text": "no messages"},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
        {
            "messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]
        },  # template raises
    ]
    f = write_records(tmp_path / "c.jsonl", good[:3] + bad + good[3:], raw_lines={5: "{not json"})
    cfg = cfg_for(tmp_path, paths=[str(f)], format="chat", tokenizer=str(toks["chat"]), seq_len=200)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = load_sft_corpus(cfg, 0, True)
    assert len(got) == 1
    assert "skipped 6 of 14 records" in str(got[0].message) and f"{f}:4: no assistant message" in str(
        got[0].message
    )
    assert c.stats["bad"] == 6 and c.stats["examples"] == 8 and "skipped 6 bad records" in c.description
    # the same records without a good one: a one-line error naming the file and the first reason
    write_records(f, bad)
    with pytest.raises(UserError, match=rf"no usable chat record.*{f}:1: no assistant message") as e:
        load_sft_corpus(cfg, 0, True)
    assert "\n" not in str(e.value)
    wrong = write_records(tmp_path / "w.jsonl", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(UserError, match=r"w\.jsonl:1: no string field 'response' \(data\.response_field\)"):
        load_sft_corpus(cfg_for(tmp_path, paths=[str(wrong)], format="instruction"), 0, True)


# ------------------------------------------------------------------------------------------------ packing


def test_packing_keeps_every_example_whole_and_its_own(tmp_path, toks):
    f = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    cfg = cfg_for(tmp_path, paths=[str(f)], format="chat", tokenizer=str(toks["chat"]), seq_len=160)
    flat, packed = load_quiet(cfg, False), load_quiet(cfg, True)
    assert len(packed.train) < len(flat.train) and packed.train.input_ids.shape[1] == 160
    assert flat.train.position_ids.tolist() == [list(range(160))] * len(flat.train)
    examples = sorted(rows(flat.train))
    parts = segments(packed.train)
    # each segment is an example exactly as it is alone (so an example's last input predicts its own last
    # token, never the next example's first) or the padding tail: pad inputs, no target
    pad = [s for s in parts if all(t == IGNORE for t in s[1])]
    assert all(set(x) == {packed.pad_id} for x, _ in pad)
    assert sorted(s for s in parts if s not in pad) == examples
    assert packed.train.trained.sum() == flat.train.trained.sum()


def test_validation_split_is_every_kth_example(tmp_path):
    recs = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(10)]
    f = write_records(tmp_path / "i.jsonl", recs)
    c = load_quiet(
        cfg_for(tmp_path, paths=[str(f)], format="instruction", seq_len=8, val_fraction=0.25), False
    )

    def first(split):  # the digit after "p": which record each row is
        return [chr(r[1]) for r in split.input_ids.tolist()]

    assert first(c.train) == list("01245689") and first(c.val) == ["3", "7"]
    write_records(f, recs[:3])  # too few for one in four: the last one is validation
    c = load_quiet(
        cfg_for(tmp_path, paths=[str(f)], format="instruction", seq_len=8, val_fraction=0.25), False
    )
    assert first(c.train) == ["0", "1"] and first(c.val) == ["2"]


# ------------------------------------------------------------------------------------------------ sources


def test_parquet_and_a_saved_dataset_give_the_examples_of_jsonl(tmp_path, toks):
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    recs = [{"messages": c, "id": i} for i, c in enumerate(CONVERSATIONS)]
    f = write_records(tmp_path / "c.jsonl", recs)
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "c.parquet", row_group_size=5)
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "saved"))
    common = {"format": "chat", "tokenizer": str(toks["chat"]), "seq_len": 128, "val_fraction": 0.2}
    ref = load_quiet(cfg_for(tmp_path, paths=[str(f)], **common), True)
    for spec in (
        {"name": "parquet", "paths": [str(tmp_path / "c.parquet")]},
        {"name": "hf", "hf_dataset": {"path": str(tmp_path / "saved")}},
    ):
        got = load_quiet(cfg_for(tmp_path, **spec, **common), True)
        for a, b in ((ref.train, got.train), (ref.val, got.val)):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
            assert torch.equal(a.position_ids, b.position_ids)
    again = load_quiet(cfg_for(tmp_path, paths=[str(f)], **common), True)  # the second load maps the cache
    assert "cached in" in again.description and torch.equal(again.train.targets, ref.train.targets)
    with pytest.raises(UserError, match=r"c\.parquet: no column 'turns' \(data\.messages_field\)"):
        load_sft_corpus(cfg_for(tmp_path, name="parquet", paths=[str(tmp_path / "c.parquet")], **common,
                                messages_field="turns"), 0, True)  # fmt: skip


# ------------------------------------------------------------------------------------------------ sampler


def fake_logits(inputs: torch.Tensor, vocab: int) -> torch.Tensor:
    """A deterministic 'model': logits that depend on each token alone, so any split of a batch agrees."""
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(3))
    return table[inputs]


def test_global_batches_and_the_loss_do_not_depend_on_the_split(tmp_path, toks):
    f = write_records(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    cfg = cfg_for(
        tmp_path, paths=[str(f)], format="chat", tokenizer=str(toks["chat"]), seq_len=96, val_fraction=0.2
    )
    corpus = load_quiet(cfg, True)
    v = corpus.vocab_size
    seen: dict[tuple, list] = {}
    for world, micro, accum in ((1, 6, 2), (2, 3, 2), (3, 2, 2), (3, 4, 1), (4, 1, 3)):
        ranks = [SFTBatches(corpus, 96, micro, accum, r, world, seed=5) for r in range(world)]
        assert ranks[0].global_batch == 12
        for step in range(4):  # 12 of the 11 sequences a step: every step crosses an epoch
            mbs = [b.micro_batch_at(step, m) for b in ranks for m in range(accum)]
            x = torch.cat([mb.inputs for mb in mbs])
            y = torch.cat([mb.targets for mb in mbs])
            trained = int((y != IGNORE).sum())
            assert all(mb.loss_divisor * world == trained for mb in mbs)
            # what the engine gets: the ranks' losses summed over accumulation, gradients averaged over ranks
            loss = sum(micro_batch_loss(fake_logits(mb.inputs, v), mb, accum) for mb in mbs) / world
            ref = F.cross_entropy(fake_logits(x, v).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
            assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
            seen.setdefault(("train", step), []).append(x)
        for n in (1, 3):  # evaluate(): mean over micro-batches and over ranks, summed over ranks
            val = [b.val_batches(n) for b in ranks]
            got = sum(
                sum(micro_batch_loss(fake_logits(mb.inputs, v), mb, 1) for mb in vb) / len(vb) / world
                for vb in val
            )
            xs = torch.cat(
                [mb.inputs for i in range(n) for vb in val for mb in vb[i * accum : (i + 1) * accum]]
            )
            ys = torch.cat(
                [mb.targets for i in range(n) for vb in val for mb in vb[i * accum : (i + 1) * accum]]
            )
            ref = F.cross_entropy(fake_logits(xs, v).flatten(0, 1), ys.flatten(), ignore_index=IGNORE)
            assert got.item() == pytest.approx(ref.item(), rel=1e-5)
            seen.setdefault(("val", n), []).append(xs)
        assert all(mb.position_ids is not None for mb in mbs)
    for key, batches in seen.items():
        assert all(torch.equal(b, batches[0]) for b in batches), key
    # a seed is a different order, and the state names the stream
    b = SFTBatches(corpus, 96, 6, 2, 0, 1, seed=6)
    assert not torch.equal(
        b.micro_batch_at(0, 0).inputs, SFTBatches(corpus, 96, 6, 2, 0, 1, 5).micro_batch_at(0, 0).inputs
    )
    with pytest.raises(UserError, match="data stream differs"):
        b.load_state_dict(SFTBatches(corpus, 96, 6, 2, 0, 1, 5).state_dict())


def test_unpacked_batches_carry_no_positions_and_an_untrained_batch_divides_by_one():
    z = torch.zeros(4, 8, dtype=torch.long)
    split = SFTSplit(z, torch.full((4, 8), IGNORE), z, torch.zeros(4, dtype=torch.long), 4)
    corpus = SFTCorpus(split, split, "", 256, 0, 0, False, {})
    b = SFTBatches(corpus, 8, 2, 1, 1, 2, seed=0)
    mb = b.micro_batch_at(0, 0)
    assert mb.position_ids is None and mb.loss_divisor == 0.5
    assert b.val_batches(1)[0].loss_divisor == 0.5  # max(T, 1) / (1 micro-batch * 2 ranks)
    assert micro_batch_loss(torch.zeros(2, 8, 256), mb, 1).item() == 0.0
