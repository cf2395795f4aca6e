"""The byte model in transformers: megatok-export's remote code (megatok/hf) opened with
``trust_remote_code=True`` gives megatok's tokens, logits, boundaries and greedy generations, with no megatok
import, for every strategy it carries; the harness's ``hf`` model gives megatok-lm-eval's figures; both
model kinds carry a model card."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import megatok
from megatok.config import load_config
from megatok.model.unet import ByteUNet
from megatok.run.hub import write_byte_transformers_files
from tests.conftest import ROOT, TOOL_ENV, decisive, python

TEXTS = ["All human beings are born free and equal in dignity and rights.",  # English
         "Tous les êtres humains naissent libres et égaux en dignité et en droits.",  # French
         "すべての人間は、生まれながらにして自由であり、かつ、尊厳と権利とについて平等である。",  # Japanese
         "x <sep> y <pad>\t\tz"]  # the special tokens' names in a text are its bytes
PROMPTS = ["All human", "Tous les ", "すべての"]

# In its own interpreter, megatok blocked: the export's tokens, logits and greedy generations (JSON on stdout).
OUTSIDE = r"""
import json, sys
sys.modules["megatok"] = None  # any import of megatok fails
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, texts, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, dtype=torch.float32).eval()
out = {"ids": [tok(t).input_ids for t in texts], "decoded": [tok.decode(tok(t).input_ids, skip_special_tokens=True) for t in texts]}
with torch.no_grad():
    out["logits"] = [model(torch.tensor([ids])).logits[0].tolist() for ids in out["ids"]]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    gen = model.generate(**enc, max_new_tokens=24, do_sample=False)
out["generated"] = [tok.decode(g[enc.input_ids.shape[1]:], skip_special_tokens=True) for g in gen]
print(json.dumps(out))
"""


def test_megatok_export_opens_in_transformers_without_megatok(tiny_run, tmp_path):
    r = python("-m", "megatok.cli.export", "--run", tiny_run, "--out", tmp_path / "byte")
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "byte"
    assert json.loads((out / "export.json").read_text())["transformers"] is True
    env = {k: v for k, v in TOOL_ENV.items() if k != "PYTHONPATH"}  # a fresh interpreter: nothing of megatok loaded
    got = subprocess.run([sys.executable, "-c", OUTSIDE, str(out), json.dumps(TEXTS), json.dumps(PROMPTS)], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    got = json.loads(got.stdout.strip().splitlines()[-1])
    ours = megatok.load(out)
    for text, ids, decoded, logits in zip(TEXTS, got["ids"], got["decoded"], got["logits"]):
        assert ids == ours.encoding.doc_ids(text.encode()).tolist() and decoded == text
        with torch.no_grad():
            want = ours.module(torch.tensor([ids[:ours.seq_len]])).logits[0]
        torch.testing.assert_close(torch.tensor(logits)[:ours.seq_len], want, rtol=0, atol=1e-4)
    want = [c.text for c in ours.generate(PROMPTS, max_bytes=24, temperature=0)]
    assert got["generated"] == want
    card = (out / "README.md").read_text()
    assert "trust_remote_code=True" in card and "held-out bits per byte" in card and "license: apache-2.0" in card


def byte_export(where, sets: list[str], seed: int = 0):
    """An export directory of a randomly initialised byte model (heads that decide, so boundaries vary)
    with megatok's files and the transformers ones, without a run: (path, megatok.load of it)."""
    cfg = load_config(None, ["model.d_model=32", "model.n_heads=2", "model.n_main_layers=2", "data.seq_len=96",
                             "train.micro_batch_size=2", *sets], world_size=1)
    torch.manual_seed(seed)
    model = ByteUNet(cfg.model, cfg.boundary)
    if cfg.boundary.strategy in ("policy", "gumbel"):
        decisive(model.boundary, 0.3)
    with torch.no_grad():  # states of a useful size: the H-Net router's cosines and the heads' logits spread
        model.embed.weight.normal_(0, 1.0)
    where.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(where / "model.safetensors"))
    (where / "megatok.json").write_text(json.dumps(cfg.to_dict()))
    (where / "export.json").write_text(json.dumps({"format": "megatok", "dtype": "fp32"}))
    assert write_byte_transformers_files(cfg, where, "fp32")
    return where, megatok.load(where, device="cpu")


VARIANTS = {
    "policy": ["boundary.strategy=policy"],
    "policy-lag1-window3": ["boundary.strategy=policy", "boundary.lag=1", "boundary.window=3"],
    "policy-documents-bytewindow": ["boundary.strategy=policy", "model.document_mask=true", "model.byte_window=16",
                                    "model.d_main=48", "model.n_main_heads=3"],
    "gumbel": ["boundary.strategy=gumbel"],
    "hnet": ["boundary.strategy=hnet"],
    "fixed": ["boundary.strategy=fixed"],
    "whitespace-at": ["boundary.strategy=whitespace", "boundary.position=at"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_remote_code_gives_megatoks_logits_boundaries_and_generations(variant, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, ours = byte_export(tmp_path / "export", VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(str(where), trust_remote_code=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(where), trust_remote_code=True)
    texts = TEXTS[:3] + ["a.b\n\nc" + chr(0) + "d"]
    rows = [ours.encoding.doc_ids(t.encode()).tolist()[:ours.seq_len] for t in texts]
    if "documents" in variant:  # a row of two documents: attention and chunks stop at the separator
        rows.append(rows[0][:20] + rows[1][:40])
    with torch.no_grad():
        for ids in rows:
            x = torch.tensor([ids])
            want = ours.module(x)
            got = hf(x)
            torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-4)
        # a left-padded batch: every row as it is alone
        batch = tok(texts[:3], return_tensors="pt", padding=True, padding_side="left")
        got = hf(**batch).logits
        for i, text in enumerate(texts[:3]):
            keep = batch.attention_mask[i].bool()
            alone = ours.module(batch.input_ids[i][keep][None]).logits[0]
            torch.testing.assert_close(got[i][keep], alone, rtol=0, atol=1e-4)
        # greedy generation with the cache: megatok's bytes, and the boundaries the forward pass decides
        enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
        gen = hf.generate(**enc, max_new_tokens=30, do_sample=False)
        want = ours.generate(PROMPTS, max_bytes=30, temperature=0)
        for g, w, prompt in zip(gen, want, PROMPTS):
            new = g[enc.input_ids.shape[1]:]
            new = new[:(new == 256).nonzero()[0, 0]] if (new == 256).any() else new
            assert bytes(new.tolist()) == w.data, (prompt, bytes(new.tolist()), w.data)
        uncached = hf.generate(**enc, max_new_tokens=30, do_sample=False, use_cache=False)
        assert torch.equal(uncached, gen)


def test_sampled_boundaries_and_sampled_bytes(tmp_path):
    """boundary_rule "sample": megatok-evaluate's seeded boundaries of a one-window document; sampled bytes
    drawn from megatok's next-byte distribution at every step."""
    from transformers import AutoModelForCausalLM

    where, _ = byte_export(tmp_path / "export", ["boundary.strategy=policy"])
    sampled = megatok.load(where, device="cpu", boundary="sample", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(where), trust_remote_code=True, dtype=torch.float32,
                                              boundary_rule="sample", boundary_seed=3).eval()
    for text in (TEXTS[0], TEXTS[1], TEXTS[2][:20]):  # documents of one window (megatok seeds each window)
        s = sampled.score(text)
        ids = torch.tensor([sampled.encoding.doc_ids(text.encode()).tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
        assert logp.sum().item() == pytest.approx(s.logprob, abs=1e-3)
    threshold = megatok.load(where, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(where), trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.tensor([threshold.encoding.doc_ids(PROMPTS[0].encode()).tolist()])
    torch.manual_seed(0)
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=20, do_sample=True, output_logits=True, return_dict_in_generate=True)
        whole = threshold.module(out.sequences).logits[0]
    n = ids.shape[1]
    for step, logits in enumerate(out.logits):  # each step's distribution is megatok's after the bytes so far
        torch.testing.assert_close(logits[0], whole[n - 1 + step], rtol=0, atol=1e-4)


def test_a_strategy_without_remote_code_exports_for_megatok_only(tmp_path):
    cfg = load_config(None, ["boundary.strategy=uniform"], world_size=1)
    assert not write_byte_transformers_files(cfg, tmp_path, "fp32") and not any(tmp_path.iterdir())


def test_the_remote_code_imports_torch_and_transformers_only():
    import ast

    for path in (ROOT / "megatok/hf").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert all(n.split(".")[0] in {"torch", "transformers", "hashlib", "math", "__future__"} for n in names), \
                (path.name, names)


def test_the_harness_hf_model_gives_megatok_lm_evals_figures(tiny_run, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from megatok.eval.harness import MegatokLM
    from megatok.run.export import export
    from tests.eval.test_harness import write_tasks

    tasks = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")))
    out = export(tiny_run, tmp_path / "export")
    hf = lm_eval.simple_evaluate(model="hf", tasks=["local_mc", "local_gen"], task_manager=tasks, device="cpu",
                                 model_args=f"pretrained={out},trust_remote_code=True,add_bos_token=True,dtype=float32",
                                 log_samples=True)
    ours = lm_eval.simple_evaluate(model=MegatokLM(model=megatok.load(out, device="cpu")), tasks=["local_mc", "local_gen"],
                                   task_manager=tasks, log_samples=True)
    assert hf["results"]["local_mc"]["acc,none"] == ours["results"]["local_mc"]["acc,none"]
    for a, b in zip(hf["samples"]["local_mc"], ours["samples"]["local_mc"]):
        for ((la, ga),), ((lb, gb),) in zip(a["resps"], b["resps"]):
            assert la == pytest.approx(lb, abs=1e-4) and ga == gb
    # generation: the harness cuts a context to the window less max_gen_toks (12) from the left, where megatok
    # reads the window ending at each new byte; the contexts that fit give the same text
    fits = [len(a["arguments"][0][0].encode()) + 1 + 12 <= 64 for a in hf["samples"]["local_gen"]]
    assert sum(fits) == 3
    assert [a["resps"] for a, f in zip(hf["samples"]["local_gen"], fits) if f] == \
        [b["resps"] for b, f in zip(ours["samples"]["local_gen"], fits) if f]
