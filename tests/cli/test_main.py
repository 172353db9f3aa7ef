import json
import subprocess
import sys

import pytest

from autopar.cli.main import main, parse_bytes


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_writes_the_documented_json(tmp_path, capsys):
    path = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", "gpt2-tiny", "--mesh", "dp=2,tp=2", "--batch", "4",
                         "--seq", "32", "--compare", "--json", str(path), "--time-limit", "10")
    assert code == 0, err
    assert "predicted step" in out and "reference plans" in out
    doc = json.loads(path.read_text())
    doc = {"version": doc["version"], **doc["decided"], **doc["predicted"], **doc["provenance"]}
    for key in ("version", "mesh", "params", "cost", "solver", "references"):
        assert key in doc
    assert doc["mesh"]["shape"] == [2, 2] and doc["mesh"]["axes"] == ["dp", "tp"]
    assert {"data_parallel", "fsdp", "megatron_tp", "dp_tp_2d"} <= set(doc["references"])
    for cost in [doc["cost"], *doc["references"].values()]:
        assert set(cost) >= {"step_s", "compute_s", "comm_s", "mem_bytes"}
    # never worse than the best reference under the same cost model
    best_ref = min(c["step_s"] for c in doc["references"].values())
    assert doc["cost"]["step_s"] <= best_ref * (1 + 1e-9)


@pytest.mark.parametrize("device, says", [
    ("cpu", "25.00 MiB each (communication does not overlap compute"),
    ("h100", "the first closes at 1.00 MiB, so its collective starts early"),
])
def test_plan_table_says_how_gradients_are_bucketed(capsys, device, says):
    code, out, err = run(capsys, "plan", "mlp-tiny", "--mesh", "dp=2", "--device", device)
    assert code == 0, err
    assert "gradient sync" in out and says in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "gpt2-tiny", "--mesh", "dp=4", "--batch", "6", "--seq", "16"], "multiple of 4"),
        (["plan", "gpt2-tinyy", "--batch", "2", "--mesh", "dp=2"], "unknown model preset"),
        (["plan", "gpt2-tiny", "--mesh", "dp=2", "--batch", "2", "--seq", "16",
          "--memory-budget", "1KiB"], "memory budget"),
        (["plan", "gpt2-tiny", "--mesh", "dp=two"], "axis=size"),
        (["plan", "gpt2-tiny", "--memory-budget", "lots"], "memory size"),
        (["plan", "no_such_module:f"], "cannot load model factory"),
        (["plan", "gpt2-tiny", "--device", "tpu"], "unknown device"),
    ],
)
def test_bad_arguments_end_with_one_clear_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


def test_parse_bytes_units():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40GB") == 40e9
    assert parse_bytes("1.5e10") == 1.5e10


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "plan" in out.stdout and "solve" in out.stdout


FACTORY = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class WithLabels(torch.nn.Module):
    """HF causal LMs take labels by keyword; autopar traces positional example inputs."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels)


def build(batch, seq):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=seq)
    model = WithLabels(LlamaForCausalLM(cfg))
    ids = torch.randint(0, 128, (batch, seq))
    return model, (ids, ids)
'''


def test_a_users_factory_plans_a_hugging_face_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_hf_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "plan", "my_hf_factory:build", "--mesh", "dp=2,tp=2",
                         "--batch", "4", "--seq", "16", "--time-limit", "5")
    assert code == 0, err
    assert "lm.model.layers.*.self_attn.q_proj.weight" in out
    assert "ops with no sharding rule" not in out


BARE_FACTORY = '''
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
'''


def test_a_factory_returning_a_bare_hugging_face_model(tmp_path, monkeypatch, capsys):
    """No example inputs: the model is called with input_ids and labels by keyword (as
    positional inputs its second would be the attention mask, and it returns no loss), and
    the reference layouts take its layers (family "hf")."""
    from autopar.cli.main import load_model
    from autopar.ir.placements import S
    from autopar.models.reference_plans import megatron_tp

    pytest.importorskip("transformers")
    (tmp_path / "bare_hf_factory.py").write_text(BARE_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = load_model("bare_hf_factory:build", 4, 16)
    assert loaded.family == "hf" and loaded.inputs == ()
    assert sorted(loaded.kwargs) == ["input_ids", "labels"]
    assert loaded.kwargs["input_ids"].shape == (4, 16)
    ref = megatron_tp(loaded.model, (2,), ("tp",), loaded.family)
    assert ref.params["model.layers.0.self_attn.q_proj.weight"] == (S(0),)
    code, out, err = run(capsys, "plan", "bare_hf_factory:build", "--mesh", "dp=2,tp=2",
                         "--batch", "4", "--seq", "16", "--time-limit", "5")
    assert code == 0, err
    assert "input_ids" in out and "model.layers.*.self_attn.q_proj.weight" in out


def test_a_factory_in_the_folder_the_command_runs_in_is_found(tmp_path, monkeypatch):
    """``autopar plan mymodels:build`` run beside mymodels.py finds it, as ``python -m``
    would (the console script's sys.path heads with its own folder, not the caller's)."""
    import os

    from autopar.cli.main import load_model

    (tmp_path / "autopar_cwd_models.py").write_text(
        "import torch\n"
        "def build(batch=2, seq=0):\n"
        "    return torch.nn.Linear(4, 1), (torch.randn(batch, 4),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    loaded = load_model("autopar_cwd_models:build", 3, 0)
    assert tuple(loaded.inputs[0].shape) == (3, 4)
