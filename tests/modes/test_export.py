"""``python -m memo.modes.export``: a checkpoint that training saved, in transformers' format,
loads in ``transformers`` and gives the logits of our model with the checkpoint's weights."""

import subprocess

import pytest
import torch

from conftest import PYTHON, REPO, one_process, resolve_config, run_in_process
from memo.execute.checkpoint import load_weights
from memo.modes.export import main
from memo.policy import build_model

transformers = pytest.importorskip("transformers")


def _trained(tmp_path, model: str):
    row = run_in_process(tmp_path / "run", f"model={model}", "seq=64", "train.steps=2", "train.warmup_steps=1",
                         "train.save_interval=2")
    assert row["status"] == "ok", row["error"]
    return tmp_path / "run" / "checkpoints" / "step_0000002"


@pytest.mark.parametrize("model, as_command", [("tiny_llama", True), ("tiny_qwen", False)])
def test_an_exported_checkpoint_gives_our_logits_in_transformers(tmp_path, capsys, model, as_command):
    saved = _trained(tmp_path, model)
    arguments = [str(saved.parent), str(tmp_path / "hf")]
    if as_command:
        done = subprocess.run([PYTHON, "-m", "memo.modes.export", *arguments], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        printed = done.stdout
    else:  # the command's own function, in this process
        assert main(arguments) == 0
        printed = capsys.readouterr().out
    assert printed.strip() == f"{saved} -> {tmp_path / 'hf'} (transformers' format)"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    run = resolve_config(f"model={model}", "seq=64")
    ids = torch.randint(0, run.workload.model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    with one_process():
        ours = build_model(run.workload, "cpu").module
        facts = load_weights(saved, [ours])
        with torch.no_grad():
            logits = ours(ids, torch.arange(64).unsqueeze(0), None)[0]
    assert facts["step"] == 2 and facts["model_config"]["name"] == model
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits[0]
    torch.testing.assert_close(theirs, logits)
    # trained weights, not the initial ones: the checkpoint's step moved them
    assert not torch.equal(hf.model.embed_tokens.weight, _initial_embedding(model))


def _initial_embedding(model: str) -> torch.Tensor:
    run = resolve_config(f"model={model}", "seq=64")
    with one_process():
        torch.manual_seed(run.train.seed)
        return build_model(run.workload, "cpu").module.embedding.word_embeddings.weight.detach().clone()


def test_a_model_transformers_has_no_format_for_is_one_line(tmp_path, capsys):
    saved = _trained(tmp_path, "tiny")
    assert main([str(saved), str(tmp_path / "hf")]) == 2 and not (tmp_path / "hf").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: model=tiny is not a Llama, Qwen2 or Qwen3 shape (SwiGLU, RMSNorm, no linear biases, q and k biases "
        "or norms, not both): transformers' format has no place for it")


def test_an_export_has_the_umask_the_tokenizer_and_its_ids_and_never_goes_into_a_run(tmp_path, capsys):
    import json
    import os
    import stat

    from tiny_corpus import make_corpus

    prefix, tokenizer, _ = make_corpus(tmp_path / "data", count=40)
    row = run_in_process(tmp_path / "run", "model=tiny_llama", "seq=64", "train.steps=1", "train.save_interval=1",
                         f"train.data=megatron:{prefix}", f"train.tokenizer={tokenizer}",
                         f"train.data_cache={tmp_path / 'cache'}")
    assert row["status"] == "ok", row["error"]
    run_dir = tmp_path / "run"
    for inside in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "step_0000001"):
        before = sorted(p.name for p in inside.iterdir())
        assert main([str(run_dir / "checkpoints"), str(inside)]) == 2
        assert "part of a training run; export to a directory of its own" in capsys.readouterr().err
        assert sorted(p.name for p in inside.iterdir()) == before
    mask = os.umask(0o027)
    try:
        assert main([str(run_dir / "checkpoints"), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(mask)
    written = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert written == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert {stat.S_IMODE((tmp_path / "hf" / n).stat().st_mode) for n in written} == {0o640}
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    eod = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").convert_tokens_to_ids("<|endoftext|>")
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"eos_token_id": eod}
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").eos_token_id == eod


def test_a_run_started_from_a_hugging_face_directory_exports_that_directorys_tokenizer(tmp_path):
    import hf_models
    from tiny_corpus import GRAMMAR_WORDS, make_tokenizer

    origin = tmp_path / "llama"
    hf_models.make_new_checkpoint("llama_tied_plain", origin)
    make_tokenizer(origin / "tokenizer.json", [GRAMMAR_WORDS])
    (origin / "generation_config.json").write_text('{"bos_token_id": 0, "eos_token_id": 1, "temperature": 0.6}\n')
    row = run_in_process(tmp_path / "run", "model=hf", f"model.init_from={origin}", "seq=64", "train.steps=1",
                         "train.save_interval=1")
    assert row["status"] == "ok", row["error"]
    assert main([str(tmp_path / "run" / "checkpoints"), str(tmp_path / "hf")]) == 0
    for name in ("tokenizer.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (origin / name).read_bytes(), name
