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
        facts = load_weights(saved, ours)
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
        "error: model=tiny is not a Llama or Qwen2 shape (SwiGLU, RMSNorm, no linear biases): transformers' format "
        "has no place for it")
