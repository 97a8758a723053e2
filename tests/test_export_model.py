"""`gdswriter export --model-only` and `--to hf`: the model's own keys, tied weights once,
files that load into the model (load_state_dict, safetensors.torch.load_model, from_pretrained)
without editing keys. Real checkpoints in tmp_path; real transformers models built from configs."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from gdswriter import GDSCheckpointer
from gdswriter.cli import main
from gdswriter.format.manifest import MANIFEST_NAME, Manifest

safetensors_torch = pytest.importorskip("safetensors.torch")


class TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one weight, as language models tie them."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _save(root, model, optimizer=None, **kw) -> None:
    with GDSCheckpointer(model, optimizer, root=root) as ck:
        ck.save(3, **kw)


def _trained(model) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_safetensors_model_only_keeps_the_models_keys_and_stores_tied_weights_once(capsys, tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    _save(tmp_path / "ck", model, _trained(model))
    out = tmp_path / "model.safetensors"
    rc, text, err = _run(capsys, "export", tmp_path / "ck", "--to", "safetensors", "--model-only", out)
    assert rc == 0, err
    assert err == ""  # no progress bar when stderr is not a terminal
    assert "'head.weight' is tied to 'embed.weight' and stored once" in text
    stored = safetensors_torch.load_file(out)
    assert set(stored) == set(model.state_dict()) - {"head.weight"}  # no "model/" prefix, no optimizer
    with safetensors_torch.safe_open(out, framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and json.loads(meta["gdswriter_tied"]) == {"head.weight": "embed.weight"}

    fresh = TiedLM()
    missing, unexpected = safetensors_torch.load_model(fresh, out)  # strict; knows tied weights
    assert not missing and not unexpected
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert fresh.head.weight is fresh.embed.weight


def test_model_only_without_ties_loads_with_plain_load_state_dict(capsys, tmp_path):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    _save(tmp_path / "ck", model, _trained(model))
    out = tmp_path / "m.safetensors"
    assert _run(capsys, "export", tmp_path / "ck", "--to", "safetensors", "--model-only", out)[0] == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    fresh.load_state_dict(safetensors_torch.load_file(out))  # strict, keys as they are
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_torch_model_only_keeps_both_tied_keys_on_one_storage(capsys, tmp_path):
    torch.manual_seed(2)
    model = TiedLM()
    _save(tmp_path / "ck", model)
    out = tmp_path / "model.pt"
    assert _run(capsys, "export", tmp_path / "ck", "--to", "torch", "--model-only", out)[0] == 0
    sd = torch.load(out, weights_only=True)
    assert set(sd) == set(model.state_dict())
    assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()
    fresh = TiedLM()
    fresh.load_state_dict(sd)  # strict
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_model_only_reads_only_the_models_bytes(capsys, tmp_path):
    """Damage in the optimizer's bytes does not stop a model-only export (it is never read),
    while the whole-state export reports it."""
    torch.manual_seed(3)
    model = torch.nn.Linear(64, 64)
    _save(tmp_path / "ck", model, _trained(model))
    step_dir = tmp_path / "ck" / "step_000000000003"
    m = Manifest.from_json_bytes((step_dir / MANIFEST_NAME).read_bytes())
    rec = next(t for t in m.tensors if t.name.startswith("optimizer/") and t.name.endswith("exp_avg_sq"))
    chunk = m.storages[rec.storage].chunks[0]
    path = step_dir / m.files[chunk.file].path
    with open(path, "r+b") as f:
        f.seek(chunk.file_offset + 5)
        b = f.read(1)
        f.seek(chunk.file_offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "safetensors", "--model-only", tmp_path / "a.st")
    assert rc == 0, err
    rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "safetensors", tmp_path / "b.st")
    assert rc == 1 and "checksum mismatch" in err and "exp_avg_sq" in err


def test_model_only_refusals(capsys, tmp_path):
    with GDSCheckpointer(root=tmp_path / "nomodel", state={"sched": {"epoch": 1}}) as ck:
        ck.save(1)
    rc, _, err = _run(capsys, "export", tmp_path / "nomodel", "--to", "safetensors", "--model-only", tmp_path / "x")
    assert rc == 2 and "holds no model state_dict" in err
    _save(tmp_path / "ck", torch.nn.Linear(2, 2))
    rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "hf", tmp_path / "hf")
    assert rc == 2 and "records no Hugging Face config" in err and "--config" in err
    assert not (tmp_path / "hf").exists()
    rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "torch", "--config", tmp_path, tmp_path / "y.pt")
    assert rc == 2 and "--config is only used with --to hf" in err
    rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "torch", "--nested", "--model-only", tmp_path / "z")
    assert rc == 2 and "nested" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "nomodel"]  # nothing half-written


# ----------------------------------------------------------------------------- Hugging Face
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(4)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   hidden_size=32, intermediate_size=64, vocab_size=96,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(5)
    return transformers.LlamaForCausalLM(cfg)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2-tied", "llama-untied"])
def test_hf_dir_from_pretrained_with_config_from_the_checkpoint(capsys, tmp_path, build):
    model = build()
    _save(tmp_path / "ck", model, _trained(model), metadata={"hf_config": model.config.to_dict()})
    out = tmp_path / "hf"
    rc, text, err = _run(capsys, "export", tmp_path / "ck", "--to", "hf", out)
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    loaded = type(model).from_pretrained(out)
    _same(model, loaded)
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
        assert "lm_head.weight" not in safetensors_torch.load_file(out / "model.safetensors")


def test_hf_dir_with_config_directory_and_force(capsys, tmp_path):
    model = _llama()
    _save(tmp_path / "ck", model)
    src = tmp_path / "pretrained"
    model.config.save_pretrained(src)
    (src / "tokenizer_config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"stale weights: never copied")
    out = tmp_path / "hf"
    assert _run(capsys, "export", tmp_path / "ck", "--to", "hf", "--config", src, out)[0] == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    _same(model, transformers.LlamaForCausalLM.from_pretrained(out))
    rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "hf", "--config", src / "config.json", out)
    assert rc == 2 and "exists" in err
    rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "hf", "--config", src / "config.json", out, "--force")
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


@pytest.mark.parametrize("exchange", [True, False])
def test_hf_dir_replacement_never_leaves_the_name_empty(capsys, tmp_path, monkeypatch, exchange):
    """--force swaps the new directory in atomically where the file system can (renameat2
    exchange); elsewhere the old one is moved aside, and put back if the new one cannot take
    its name: at no point does a failure leave no directory under the output's name."""
    import gdswriter.fs as fs

    model = _llama()
    _save(tmp_path / "ck", model)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"old": true}')
    config = tmp_path / "config.json"
    model.config.to_json_file(config)
    if not exchange:
        monkeypatch.setattr(fs, "exchange_paths", lambda a, b: False)  # fs.replace_dir's
        real_rename = os.rename

        def rename(src, dst):
            if Path(src).name.startswith(".hf.tmp-"):
                raise OSError(errno.EIO, "injected", str(src))
            return real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)
        rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "hf", "--config", config, out, "--force")
        assert rc == 1 and "injected" in err
        assert json.loads((out / "config.json").read_text()) == {"old": True}, "the old output was not put back"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        monkeypatch.setattr(os, "rename", real_rename)
    rc, _, err = _run(capsys, "export", tmp_path / "ck", "--to", "hf", "--config", config, out, "--force")
    assert rc == 0, err
    _same(model, transformers.LlamaForCausalLM.from_pretrained(out))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_output_that_appears_while_exporting_is_kept_and_the_export_refused(tmp_path):
    """Without overwrite the finished file takes its name by a no-clobber link (fs.atomic_file):
    another writer's file that appeared meanwhile is never replaced, and no temporary is left.
    A FileExistsError of the block itself stays what it is."""
    from gdswriter.errors import OutputExistsError
    from gdswriter.export import write_safetensors

    out = tmp_path / "w.safetensors"

    def appear(n: int) -> None:
        if not out.exists():
            out.write_bytes(b"another writer's")

    with pytest.raises(OutputExistsError, match="--force"):
        write_safetensors(out, {"w": torch.ones(4)}, on_written=appear)
    assert out.read_bytes() == b"another writer's"
    assert os.listdir(tmp_path) == ["w.safetensors"]

    def fail(n: int) -> None:
        raise FileExistsError(errno.EEXIST, "the block's own")

    with pytest.raises(FileExistsError, match="the block's own") as caught:
        write_safetensors(tmp_path / "v.safetensors", {"w": torch.ones(4)}, on_written=fail)
    assert not isinstance(caught.value, OutputExistsError)
    assert os.listdir(tmp_path) == ["w.safetensors"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_model_only_export_of_a_dcp_step_with_a_model_entry(capsys, tmp_path):
    """Issue 26 item 4: a step saved with dcp.save({"model": ..., "optim": ...}) through
    GDSStorageWriter exports --model-only under the model's own keys (from DCP's planner data),
    loads with safetensors' load_model, reads only the model's bytes (damage in the optimizer's
    does not stop it); a DCP step without a "model" entry is refused naming its keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from gdswriter.distributed import GDSStorageWriter

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 300))  # 2 MiB
    opt = _trained(model)
    path = tmp_path / "checkpoint" / "step-7"
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt), "step": 7},
             checkpoint_id=path, storage_writer=GDSStorageWriter(), no_dist=True)
    m = Manifest.from_json_bytes((path / "step_000000000007" / MANIFEST_NAME).read_bytes())
    rec = next(t for t in m.tensors if t.name.endswith("exp_avg_sq"))
    chunk = m.storages[rec.storage].chunks[0]
    with open(path / "step_000000000007" / m.files[chunk.file].path, "r+b") as f:
        f.seek(chunk.file_offset + 9)
        b = f.read(1)
        f.seek(chunk.file_offset + 9)
        f.write(bytes([b[0] ^ 0xFF]))
    out = tmp_path / "model.safetensors"
    rc, text, err = _run(capsys, "export", path, "--to", "safetensors", "--model-only", out)
    assert rc == 0, err
    assert "7" in text and "the model's state_dict" in text
    fresh = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 300))
    missing, unexpected = safetensors_torch.load_model(fresh, out)
    assert not missing and not unexpected
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    rc, _, err = _run(capsys, "export", path, "--to", "safetensors", tmp_path / "all.st")
    assert rc == 1 and "checksum mismatch" in err  # the whole state reads the damaged optimizer bytes

    flat = tmp_path / "flat"
    dcp.save(dict(model.state_dict()), checkpoint_id=flat, storage_writer=GDSStorageWriter(), no_dist=True)
    rc, _, err = _run(capsys, "export", flat, "--to", "safetensors", "--model-only", tmp_path / "x")
    assert rc == 2 and 'no "model" entry' in err and "0, 2" in err
