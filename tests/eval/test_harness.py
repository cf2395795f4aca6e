"""lm-evaluation-harness on both model kinds, over local task files (a YAML task over a local JSONL file:
no hub, no network): perplexity figures equal megatok's own scoring, multiple choice and generation equal
the API's answers, and the megatok-lm-eval command."""

from __future__ import annotations

import json
import math

import pytest

import megatok
from megatok.data.documents import Document
from megatok.eval.bpb import evaluate_documents
from tests.conftest import PARALLEL

DOCS = [*(" ".join(v) for v in PARALLEL.values()), "def main(argv=None):\n    return 0\n" * 3]
QUESTIONS = [("The capital of France is", [" Paris", " Rome", " Berlin"], 0), ("def f(x): return", [" x", " y"], 1),
             ("All human beings are", [" born free", " asleep"], 0),
             ("def main(argv=None):\n    return 0\n" * 4 + "All human beings are", [" born free", " asleep"], 0)]
# (the last context is longer than either model's window: the harness gives the API's figures there too)


def write_tasks(where):
    """Three tasks over local JSON lines files: perplexity, multiple choice, generation."""
    where.mkdir(exist_ok=True)
    with (where / "docs.jsonl").open("w") as f:
        for d in DOCS:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    with (where / "questions.jsonl").open("w") as f:
        for q, choices, gold in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "gold": gold}) + "\n")
    local = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (where / "ppl.yaml").write_text(
        "task: local_ppl\n" + local.format(where / "docs.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
        "  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (where / "mc.yaml").write_text(
        "task: local_mc\n" + local.format(where / "questions.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n')
    (where / "gen.yaml").write_text(
        "task: local_gen\n" + local.format(where / "questions.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{choices[gold]}}"\n'
        'generation_kwargs:\n  until: [" "]\n  max_gen_toks: 12\nmetric_list:\n  - metric: exact_match\n')
    return where


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The task files, and one lm_eval TaskManager over them (it indexes the harness's ~14,000 built-in
    task files, seconds each time: built once for the file, as megatok-lm-eval builds it)."""
    from lm_eval.tasks import TaskManager

    where = write_tasks(tmp_path_factory.mktemp("tasks"))
    return where, TaskManager(include_path=str(where))


@pytest.mark.parametrize("kind", ["unet", "bpe"])
def test_local_tasks_give_megatoks_own_figures(kind, tiny_run, bpe_run, tasks):
    import lm_eval

    from megatok.eval.harness import MegatokLM

    model = megatok.load(tiny_run if kind == "unet" else bpe_run)
    out = lm_eval.simple_evaluate(model=MegatokLM(model=model), tasks=["local_ppl", "local_mc", "local_gen"],
                                  task_manager=tasks[1], log_samples=True)
    res = out["results"]
    # perplexity: the harness's bits per byte over the documents is megatok's over the same bytes
    scores = model.score_many(DOCS)
    n_bytes = sum(s.bytes for s in scores)
    bpb = -sum(s.logprob for s in scores) / n_bytes / math.log(2)
    assert res["local_ppl"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-9)
    assert res["local_ppl"]["byte_perplexity,none"] == pytest.approx(2 ** bpb, rel=1e-9)
    evaluated = evaluate_documents(model.module, iter(Document(d.encode(), None, None, "") for d in DOCS),
                                   seq_len=model.seq_len, batch_size=8, mode="threshold", seed=0, device="cpu",
                                   encoding=model.encoding)
    assert evaluated["bytes"] == n_bytes and res["local_ppl"]["bits_per_byte,none"] == pytest.approx(
        evaluated["bpb"], rel=1e-9)
    # multiple choice: the choice with the highest log-likelihood, as the API computes it
    picks = []
    for q, choices, gold in QUESTIONS:
        lls = [ll for ll, _ in model.loglikelihoods([(q, c) for c in choices])]
        picks.append(float(lls.index(max(lls)) == gold))
    assert res["local_mc"]["acc,none"] == pytest.approx(sum(picks) / len(picks))
    # generation: greedy, cut at the stop string
    answers = [s["resps"][0][0] for s in sorted(out["samples"]["local_gen"], key=lambda s: s["doc_id"])]
    want = [model.generate(q, max_bytes=12 if kind == "unet" else 36, temperature=0, stop=" ").text for q, _, _ in QUESTIONS]
    assert answers == want and all(" " not in a for a in answers)


def test_the_command_runs_a_task_list_on_an_export(bpe_run, tasks, tmp_path, capsys, monkeypatch):
    """megatok-lm-eval's main, in this process (lm_eval is imported once for the file); the TaskManager it
    builds for --include-path is the file's (the same arguments: checked)."""
    import lm_eval.tasks

    from megatok.cli.lm_eval import main
    from megatok.run.export import export

    tasks, manager = tasks

    def shared(include_path=None, **kw):
        assert include_path == str(tasks) and not kw
        return manager

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", shared)
    out = export(bpe_run, tmp_path / "export")
    assert main(["--model", str(out), "--tasks", "local_ppl", "--include-path", str(tasks),
                 "--output", str(tmp_path / "results.json")]) == 0
    printed = capsys.readouterr().out
    assert "local_ppl" in printed and "bits_per_byte" in printed
    results = json.loads((tmp_path / "results.json").read_text())
    scores = megatok.load(out).score_many(DOCS)
    bpb = -sum(s.logprob for s in scores) / sum(s.bytes for s in scores) / math.log(2)
    assert results["kind"] == "bpe" and results["results"]["local_ppl"]["bits_per_byte,none"] == pytest.approx(bpb)
    assert main(["--model", str(out), "--tasks", "local_ppl,nope", "--include-path", str(tasks)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --tasks: unknown task nope")
    built = []  # a mistyped --model is told before the harness indexes its tasks (seconds), even with bad tasks
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: built.append(kw) or manager)
    assert main(["--model", str(tmp_path / "none"), "--tasks", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: --model {tmp_path / 'none'}: neither a megatok run directory") and not built


def test_the_harness_hf_model_opens_a_bpe_export(bpe_run, tasks, tmp_path):
    """``lm_eval --model hf`` on the BPE model's export (accelerate is one of megatok's requirements): its
    log-likelihoods are megatok's wherever the harness's tokens for context + continuation are megatok's
    (megatok tokenizes the two apart; ``hf`` cuts the tokens of the whole text after the context's)."""
    import lm_eval
    from transformers import AutoTokenizer

    from megatok.run.export import export

    out = export(bpe_run, tmp_path / "export")
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},add_bos_token=True,dtype=float32",
                                  tasks=["local_mc"], task_manager=tasks[1], device="cpu", log_samples=True)
    model, tok = megatok.load(out), AutoTokenizer.from_pretrained(str(out))
    compared = 0
    for sample in res["samples"]["local_mc"]:
        for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"]):
            if tok(context + continuation).input_ids != tok(context).input_ids + tok(continuation).input_ids[1:]:
                continue  # a token spans the join: the two tokenizations differ
            want = model.loglikelihood(context, continuation)
            assert ll == pytest.approx(want[0], abs=1e-3) and greedy == want[1]
            compared += 1
    assert compared >= 6
    # perplexity: the harness puts the beginning token before each rolling window itself, so the tokenizer's
    # must be off (add_bos_token=True scores a second </s> as if it were text)
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},add_bos_token=False,dtype=float32",
                                  tasks=["local_ppl"], task_manager=tasks[1], device="cpu")
    scores = model.score_many(DOCS)
    bpb = -sum(s.logprob for s in scores) / sum(s.bytes for s in scores) / math.log(2)
    got = res["results"]["local_ppl"]["bits_per_byte,none"]
    assert got == pytest.approx(bpb, rel=1e-3)  # a document past a window is cut into the harness's rolling windows
    # (measured: 4.9121 here against megatok's 4.9116; with add_bos_token=True, 4.9728)


def test_an_empty_perplexity_document_has_log_probability_0(tiny_run):
    from lm_eval.api.instance import Instance

    from megatok.eval.harness import MegatokLM

    lm = MegatokLM(model=megatok.load(tiny_run))
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate([DOCS[0], "", DOCS[1]])]
    got = lm.loglikelihood_rolling(requests, disable_tqdm=True)
    assert got[1] == 0.0 and got[::2] == [s.logprob for s in lm.model.score_many(DOCS[:2])]


def test_requests_are_batched_longest_first_and_answered_as_alone(tiny_run):
    """generate_until: requests with the same arguments decoded together (batch_size at a time, the longest
    context first), each answer the one its request gets alone; loglikelihood: scored longest first."""
    from lm_eval.api.instance import Instance

    from megatok.eval.harness import MegatokLM

    lm = MegatokLM(model=megatok.load(tiny_run, batch_size=2))
    calls, generate, loglikelihoods = [], lm.model.generate, lm.model.loglikelihoods
    lm.model.generate = lambda prompts, **kw: calls.append((prompts, kw["stop"])) or generate(prompts, **kw)
    lm.model.loglikelihoods = lambda pairs: calls.append(pairs) or loglikelihoods(pairs)
    asks = [("a", "x"), ("three", "x"), ("tw", "y"), ("four", "x"), ("fives", "y")]
    requests = [Instance("generate_until", {}, (c, {"until": [u], "max_gen_toks": 6, "do_sample": True}), i)
                for i, (c, u) in enumerate(asks)]
    got = lm.generate_until(requests, disable_tqdm=True)
    assert calls == [(["three", "four"], ["x"]), (["a"], ["x"]), (["fives", "tw"], ["y"])]
    assert got == [generate(c, max_bytes=6, temperature=1.0, stop=[u], seed=i).text for i, (c, u) in enumerate(asks)]
    calls.clear()
    pairs = [("ab", " c"), ("abcdef", " g"), ("abc", " d")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    assert calls == [[pairs[1], pairs[2], pairs[0]]] and got == loglikelihoods(pairs)
