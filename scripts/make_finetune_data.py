"""The fine-tuning example's inputs, generated here in seconds from what every machine has (no download):

    python scripts/make_finetune_data.py           # writes examples/finetune/tiny-llama/ (chat.jsonl ships)
    python scripts/make_finetune_data.py --out DIR --force    # both anew

chat.jsonl: conversations about the Python standard library: a user asks what `json.dumps` (say) does, in one
of several phrasings a seeded RNG picks, and the assistant answers with the first paragraph of its docstring;
some open with a system message, some go on for a second turn. The docstrings are the running Python's, so
the file is the same on every machine with the same Python version.

tiny-llama/: a LlamaForCausalLM with random weights (4 layers, hidden 128) saved as safetensors, beside a
byte-level BPE tokenizer trained on chat.jsonl with a ChatML chat template: <|im_end|> ends a turn (eos),
<|endoftext|> pads. The model's vocab_size is the tokenizer's length.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
RECORDS = 1200
MAX_ANSWER = 420  # characters: answers stay short enough for seq_len 256 with this small vocabulary
VOCAB = 1536
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, turn end (eos)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Modules that import without side effects on every platform, with documented public callables.
MODULES = (
    "abc argparse array base64 binascii bisect calendar cmath codecs collections colorsys contextlib copy csv "
    "dataclasses datetime decimal difflib enum filecmp fnmatch fractions functools glob gzip hashlib heapq hmac "
    "html inspect io ipaddress itertools json keyword linecache locale math mimetypes numbers operator os "
    "os.path pathlib pickle pprint queue random re reprlib secrets shlex shutil statistics string struct "
    "tempfile textwrap threading time timeit tokenize traceback types typing unicodedata urllib.parse uuid "
    "warnings weakref zipfile zlib"
).split()
ASK = (
    "What does `{name}` do?",
    "Can you explain `{name}`?",
    "What is `{name}` for?",
    "In Python, what does `{name}` do?",
    "I found a call to `{name}` in some code. What does it do?",
    "Briefly, what is `{name}`?",
    "Explain the standard library's `{name}` in a sentence or two.",
    "How would you describe `{name}`?",
)
ANSWER = ("{doc}", "`{name}`: {doc}", "{doc}", "In short: {doc}")
SYSTEM = (
    "You are a concise assistant that explains the Python standard library.",
    "Answer questions about Python briefly and precisely.",
    "You help programmers read Python code.",
)
FOLLOW_UP = ("Which module is it in?", "Where does it live?", "What do I import to use it?")


def first_paragraph(obj: object) -> str | None:
    """The docstring's first paragraph on one line, cut at a sentence end near MAX_ANSWER; None if unusable."""
    if not isinstance(getattr(obj, "__doc__", None), str):
        return None  # its own docstring only: getdoc would lend a subclass its base's ("Base class for ...")
    doc = inspect.cleandoc(obj.__doc__)
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if len(para) < 25 or "(" in para[:1] or para.lower().startswith(("see ", "alias", "deprecated")):
        return None  # signature lines ("dumps(obj, ...)"), pointers elsewhere: not an answer
    if len(para) > MAX_ANSWER:
        cut = para.rfind(". ", 0, MAX_ANSWER)
        para = para[: cut + 1] if cut > 40 else para[:MAX_ANSWER].rsplit(" ", 1)[0] + " ..."
    return para


def documented() -> list[tuple[str, str, str]]:
    """(module, qualified name, first paragraph) of each documented public function or class, sorted."""
    found = []
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # a module this build lacks (zlib without its library, say)
            continue
        listed = getattr(mod, "__all__", None)  # the module's public API, wherever each name is defined
        own = [n for n in dir(mod) if not n.startswith("_") and _defined_in(getattr(mod, n), mod_name)]
        for attr in sorted(set(listed or own)):
            obj = getattr(mod, attr, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = first_paragraph(obj)
            if doc:
                found.append((mod_name, f"{mod_name}.{attr}", doc))
    return found


def _defined_in(obj: object, mod_name: str) -> bool:
    """Defined by the module or its C accelerator (_json for json), not imported from another module."""
    top = mod_name.split(".")[0]
    return (getattr(obj, "__module__", None) or "").split(".")[0] in (top, "_" + top)


def conversations(items: list[tuple[str, str, str]], n: int, rng: random.Random) -> list[dict]:
    order = list(range(len(items)))
    rng.shuffle(order)
    records = []
    for k in range(n):
        mod, name, doc = items[order[k % len(order)]]
        messages = [
            {"role": "user", "content": rng.choice(ASK).format(name=name)},
            {"role": "assistant", "content": rng.choice(ANSWER).format(name=name, doc=doc)},
        ]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM)})
        turn = rng.random()
        if turn < 0.1:  # a second question about where it lives
            messages += [
                {"role": "user", "content": rng.choice(FOLLOW_UP)},
                {"role": "assistant", "content": f"It is in the `{mod}` module: `import {mod}`."},
            ]
        elif turn < 0.2:  # a second question about another name of the same module
            _, other, other_doc = rng.choice([it for it in items if it[0] == mod])
            messages += [
                {"role": "user", "content": f"And `{other}`?"},
                {"role": "assistant", "content": other_doc},
            ]
        records.append({"messages": messages})
    return records


def render(record: dict) -> str:
    """ChatML by hand: what the tokenizer is trained on (the same text the chat template writes)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in record["messages"])


def write_tokenizer(folder: Path, texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.ByteLevel()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # every byte has a token: no text is ever unknown
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=alphabet)
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.model_max_length = 512
    fast.save_pretrained(str(folder))
    return fast


def write_model(folder: Path, tok) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,  # the ChatML template writes no BOS
        # A forward that builds a KV cache ignores packed position_ids (transformers' masking_utils detects
        # packing only without one): training calls take per-example attention with no use_cache argument.
        use_cache=False,
    )
    torch.manual_seed(SEED)  # the random weights are the same each run
    model = LlamaForCausalLM(config)
    model.generation_config.use_cache = True  # generate() still caches
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "examples" / "finetune")
    ap.add_argument("--force", action="store_true", help="replace chat.jsonl and tiny-llama/ if present")
    args = ap.parse_args(argv)
    data, model_dir = args.out / "chat.jsonl", args.out / "tiny-llama"
    # chat.jsonl ships with the repository (a newer Python's docstrings would give another file): it is kept
    # unless --force; the model folder is written once, from it.
    if data.exists() and model_dir.exists() and not args.force:
        print(f"make_finetune_data: {data} and {model_dir} are there already (--force writes them anew)")
        return 0
    if args.force or not data.exists():
        items = documented()
        records = conversations(items, RECORDS, random.Random(SEED))
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        turns = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in records)
        print(
            f"wrote {data}: {len(records)} conversations ({turns} answers) about {len(items)} documented names, "
            f"{data.stat().st_size / 2**20:.2f} MiB"
        )
    else:
        records = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
        print(f"kept {data}: {len(records)} conversations")
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    tok = write_tokenizer(model_dir, [render(r) for r in records])
    params = write_model(model_dir, tok)
    files = ", ".join(sorted(f.name for f in model_dir.iterdir()))
    print(
        f"wrote {model_dir}: LlamaForCausalLM, {params:,} random parameters, vocab {len(tok)} (eos "
        f"{tok.eos_token} = {tok.eos_token_id}, pad {tok.pad_token} = {tok.pad_token_id}), ChatML chat template; "
        f"files: {files}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
