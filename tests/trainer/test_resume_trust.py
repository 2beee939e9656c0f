"""Resume trusts only what this installation wrote: signed checkpoints and run specs, no code from a spec.

Unit tests use a fake DeepSpeed engine that saves and loads with torch.save / torch.load(weights_only=False),
as DeepSpeed does, so a planted pickle would run if anything loaded it. One ComfyUI-tier test plants a run
through ComfyUI's own upload route and queues a run with resume = latest.
"""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, evaluate_on_one_image, load_workflow
from ingraph_trainer.runner import runs
from ingraph_trainer.trainer.run import checkpoint as ckpt
from ingraph_trainer.trainer.run import trust
from ingraph_trainer.trainer.spec import RunSpecError, spec_from_dict

MODEL_FILE = "mp_rank_00_model_states.pt"


@pytest.fixture(autouse=True)
def secret(tmp_path, monkeypatch):
    path = tmp_path / "config" / "secret"
    monkeypatch.setenv(trust.SECRET_ENV, str(path))
    return path


class _Payload:
    """Unpickling it writes the marker file: what a planted checkpoint would do."""
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


class FakeEngine:
    """Saves and loads like DeepSpeed: one pickle per rank, read back with torch.load(weights_only=False)."""
    def __init__(self):
        self.complete_when_saving = []

    def save_checkpoint(self, root, tag, client_state, save_latest, exclude_frozen_parameters):
        import torch
        final = Path(root) / ckpt.tag_for(client_state["trainer"]["step"])
        self.complete_when_saving.append((final / ckpt.COMPLETE_MARK).exists())
        (Path(root) / tag).mkdir(parents=True)
        torch.save({"client": client_state}, Path(root) / tag / MODEL_FILE)

    def load_checkpoint(self, root, tag, **_):
        import torch
        return None, torch.load(Path(root) / tag / MODEL_FILE, weights_only=False)["client"]


def save(engine, run_dir, step, keep_last=0):
    return ckpt.save_checkpoint(engine, run_dir, step, {"step": step, "seed": 0}, True, keep_last=keep_last)


def plant_pickle(path: Path, marker: Path, same_size: bool):
    payload = pickle.dumps(_Payload(marker), protocol=2)
    size = path.stat().st_size if path.exists() else len(payload)
    assert len(payload) <= size
    path.write_bytes(payload + b"\0" * (size - len(payload)) if same_size else payload)


@pytest.mark.parametrize("change", ["same_size", "other_size", "added_file"])
def test_a_checkpoint_changed_after_signing_is_refused_before_loading(tmp_path, change):
    engine, marker = FakeEngine(), tmp_path / "pwned"
    path = save(engine, tmp_path / "run", 4)
    assert ckpt.load_checkpoint(engine, path)["step"] == 4  # the untouched checkpoint loads
    target = path / (MODEL_FILE if change != "added_file" else "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    plant_pickle(target, marker, same_size=change == "same_size")
    # a same-size change passes the cheap listing check; loading checks every digest
    assert ckpt.is_complete(path) == (change == "same_size")
    with pytest.raises(ckpt.UntrustedCheckpoint, match=f"checkpoint {path}.*(changed|differ)"):
        ckpt.load_checkpoint(engine, path)
    assert not marker.exists()
    if change != "added_file":  # the planted file is live: loading it without the check runs its code
        with pytest.raises(Exception):
            engine.load_checkpoint(str(path.parent), path.name)
        assert marker.read_text() == "pwned"


def test_a_mark_not_signed_with_this_installations_secret_is_not_complete(tmp_path, secret, monkeypatch):
    engine = FakeEngine()
    path = save(engine, tmp_path / "run", 2)
    assert ckpt.complete_checkpoints(tmp_path / "run") == [path]
    monkeypatch.setenv(trust.SECRET_ENV, str(tmp_path / "other-secret"))
    assert ckpt.complete_checkpoints(tmp_path / "run") == []
    with pytest.raises(ckpt.UntrustedCheckpoint, match="not signed by this installation"):
        ckpt.load_checkpoint(engine, path)
    with pytest.raises(ckpt.UntrustedCheckpoint, match="step_000002"):
        ckpt.resolve_resume(tmp_path / "run", "step_000002")
    assert ckpt.resolve_resume(tmp_path / "run", "latest") is None


def test_the_secret_is_created_once_private_and_shared(tmp_path, secret):
    first = trust.installation_secret()
    assert secret.stat().st_mode & 0o777 == 0o600 and len(first) == 32
    trust._cached.clear()
    assert trust.installation_secret() == first


def make_run(root: Path, run_id: str, output_name: str, tags=(2,)) -> Path:
    """A run as the runner and the trainer write it, signed with whatever secret is current."""
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "run.toml").write_text(f'[output]\nname = "{output_name}"\n')
    (run_dir / "dataset.json").write_text("{}")
    for step in tags:
        save(FakeEngine(), run_dir, step)
    trust.sign_run(run_dir, ["run.toml", "dataset.json"])
    return run_dir



def test_each_server_signs_with_its_data_folders_secret_and_moves_its_old_runs_there(tmp_path, monkeypatch):
    """Two servers sharing a home (and so ~/.config) used to share one secret, and trust each other's runs. Each
    now signs with the secret in its own data folder; a server's runs signed with the home folder's secret before
    are re-signed once, and a run signed with that old secret afterwards (by the other server) is not trusted."""
    from ingraph_trainer.runner import paths
    monkeypatch.delenv(trust.SECRET_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home_config"))
    assert trust.secret_path() == tmp_path / "home_config" / "ingraph-trainer" / "secret"
    runs_a, evals_a = tmp_path / "a" / "runs", tmp_path / "a" / "evals"
    mine = make_run(runs_a, "mine", "mine")  # signed with the home folder's secret, as before
    evaluation = make_run(evals_a, "eval", "eval", tags=())
    monkeypatch.setenv(trust.SECRET_ENV, str(tmp_path / "attacker"))
    planted = make_run(runs_a, "planted", "planted")
    monkeypatch.delenv(trust.SECRET_ENV)

    def server(name):
        monkeypatch.delenv(trust.SECRET_ENV, raising=False)
        monkeypatch.setattr(paths, "data_root", lambda: tmp_path / name / "ingraph_data")
        monkeypatch.setattr(paths, "runs_root", lambda: tmp_path / name / "runs")
        monkeypatch.setattr(paths, "evals_root", lambda: tmp_path / name / "evals")
        return paths.use_data_folder_secret()
    assert server("a") == tmp_path / "a" / "ingraph_data" / "secret"
    assert trust.secret_path() == tmp_path / "a" / "ingraph_data" / "secret"  # the trainers it starts inherit it
    assert (tmp_path / "a" / "ingraph_data" / "secret").stat().st_mode & 0o777 == 0o600
    assert trust.run_is_trusted(mine, "run.toml") and trust.run_is_trusted(evaluation, "run.toml")
    assert [p.name for p in ckpt.complete_checkpoints(mine)] == ["step_000002"]
    assert not trust.run_is_trusted(planted, "run.toml") and ckpt.complete_checkpoints(planted) == []

    monkeypatch.delenv(trust.SECRET_ENV)
    late = make_run(runs_a, "late", "late")  # the home folder's secret, after the move: another server's
    server("a")
    assert not trust.run_is_trusted(late, "run.toml") and ckpt.complete_checkpoints(late) == []
    server("b")  # a second server in the same home: its own secret, none of the first one's runs
    assert trust.secret_path() == tmp_path / "b" / "ingraph_data" / "secret"
    assert not trust.run_is_trusted(mine, "run.toml") and ckpt.complete_checkpoints(mine) == []


def test_by_hand_the_trainer_signs_with_the_secret_of_its_comfyuis_server(tmp_path, monkeypatch):
    """A Train node's run resumed by hand (README: the trainer on its own) verifies with the server's secret."""
    from ingraph_trainer.trainer import main
    comfyui = tmp_path / "ComfyUI"
    (comfyui / "comfy").mkdir(parents=True)
    (comfyui / "comfy" / "model_management.py").write_text("")
    monkeypatch.setenv("COMFYUI_PATH", str(comfyui))
    monkeypatch.delenv(trust.SECRET_ENV)
    monkeypatch.delenv("INGRAPH_DATA_DIR", raising=False)
    main.use_the_servers_secret()  # no server ever ran here: the home folder's
    assert trust.SECRET_ENV not in __import__("os").environ
    (comfyui / "ingraph_data").mkdir()
    trust.installation_secret(comfyui / "ingraph_data" / "secret")
    main.use_the_servers_secret()
    assert trust.secret_path() == comfyui / "ingraph_data" / "secret"
    monkeypatch.setenv(trust.SECRET_ENV, str(tmp_path / "operator"))  # the operator's choice stands
    main.use_the_servers_secret()
    assert trust.secret_path() == tmp_path / "operator"

def test_a_planted_run_is_never_resumable(tmp_path, secret, monkeypatch, caplog):
    root = tmp_path / "runs"
    own = make_run(root, "20260101-000000-mine-aaaa", "mine")
    monkeypatch.setenv(trust.SECRET_ENV, str(tmp_path / "attacker-secret"))
    planted = make_run(root, "29990101-000000-mine-ffff", "mine")  # newer, same output name
    unsigned = root / "29990101-000000-mine-eeee"  # the old format: a bare COMPLETE, no run signature
    (unsigned / "checkpoints" / "step_000009").mkdir(parents=True)
    (unsigned / "run.toml").write_text('[output]\nname = "mine"\n')
    (unsigned / "checkpoints" / "step_000009" / "trainer_state.json").write_text('{"step": 9}')
    (unsigned / "checkpoints" / "step_000009" / ckpt.COMPLETE_MARK).write_text("9")
    monkeypatch.setenv(trust.SECRET_ENV, str(secret))

    assert runs.resumable_checkpoints(root) == [f"{own.name}/step_000002"]
    with caplog.at_level("WARNING", logger="ingraph_trainer"):
        assert runs.resolve_resume_choice(root, "latest", "mine") == (own, "step_000002")
    assert f"run {planted.name} is not signed by this installation" in caplog.text
    for bad in (planted, unsigned):
        tag = "step_000002" if bad == planted else "step_000009"
        with pytest.raises(ValueError, match=bad.name):
            runs.resolve_resume_choice(root, f"{bad.name}/{tag}", "mine")

    # a signed run whose spec changed after signing is no longer trusted, even with its checkpoint intact
    (own / "run.toml").write_text('[output]\nname = "mine"\n[model]\ncomfyui_path = "/tmp"\n')
    assert runs.resolve_resume_choice(root, "latest", "mine") is None
    with pytest.raises(ValueError, match=f"run {own.name!r} was not written by this installation"):
        runs.resolve_resume_choice(root, f"{own.name}/step_000002", "mine")


def test_a_checkpoint_copied_into_another_run_or_tag_is_refused(tmp_path):
    root = tmp_path / "runs"
    own = make_run(root, "20260101-000000-mine-aaaa", "mine")
    copy = root / "20260102-000000-mine-bbbb"
    import shutil
    shutil.copytree(own, copy)  # every file signed, but for another run id
    assert runs.resolve_resume_choice(root, "latest", "mine") == (own, "step_000002")
    shutil.copytree(own / "checkpoints" / "step_000002", own / "checkpoints" / "step_000007")
    assert runs.complete_checkpoints(own) == ["step_000002"]
    # only the checkpoint (its mark and files, every digest right) planted into another signed run of the same
    # name: that run does not take it as its own (issue 28, finding 5)
    victim = make_run(root, "20260103-000000-mine-cccc", "mine", tags=())
    shutil.copytree(own / "checkpoints" / "step_000002", victim / "checkpoints" / "step_000002")
    assert runs.complete_checkpoints(victim) == []
    with pytest.raises(ckpt.UntrustedCheckpoint, match=r"signed for run '20260101-000000-mine-aaaa', not this run "
                                                        r"'20260103-000000-mine-cccc'"):
        ckpt.verify_checkpoint(victim / "checkpoints" / "step_000002")


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path):
    engine = FakeEngine()
    for step in range(1, 6):
        save(engine, tmp_path / "kept", step, keep_last=3)
        save(engine, tmp_path / "all", step, keep_last=0)
    names = lambda d: sorted(p.name for p in (tmp_path / d / "checkpoints").iterdir())  # noqa: E731
    assert names("kept") == ["step_000003", "step_000004", "step_000005"]
    assert len(names("all")) == 5
    # a resumed run saving an older step than the newest one keeps what it just wrote
    save(engine, tmp_path / "kept", 2, keep_last=1)
    assert names("kept") == ["step_000002", "step_000005"]


def test_saving_over_a_tag_removes_its_mark_first_and_drops_planted_files(tmp_path):
    engine = FakeEngine()
    path = save(engine, tmp_path / "run", 4)
    (path / "planted.pt").write_bytes(b"not ours")
    save(engine, tmp_path / "run", 4)
    assert engine.complete_when_saving == [False, False]  # no COMPLETE while DeepSpeed rewrote the tag
    assert ckpt.verify_checkpoint(path) and not (path / "planted.pt").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob(f"{ckpt.PARTIAL_PREFIX}*"))


def _spec(**model) -> dict:
    return {"run_dir": "/tmp/r", "model": {"path": "/m/model.safetensors", **model}, "data": {"manifest": "/d.json"},
            "output": {"lora_path": "/o.safetensors"}}


def test_spec_weights_must_be_safetensors_and_keep_last_is_checked():
    spec_from_dict(_spec())
    for table, key, value in (("model", "path", "/m/model.ckpt"), ("adapter", "init_from", __file__),
                              ("samples", "vae_path", "/v.pt"), ("samples", "conditioning", "/c.pth")):
        data = _spec()
        if table == "samples":
            data["samples"] = {"every": 1, "prompts": ["a"], "conditioning": "/c.safetensors",
                               "vae_path": "/v.safetensors"}
        data.setdefault(table, {})[key] = value
        with pytest.raises(RunSpecError, match=rf"{table}\.{key}: must be a \.safetensors file"):
            spec_from_dict(data)
    with pytest.raises(RunSpecError, match="train.keep_last"):
        spec_from_dict(dict(_spec(), train={"keep_last": -1}))
    assert spec_from_dict(_spec()).train.keep_last == 3


def test_a_spec_naming_a_comfyui_path_is_refused_and_imports_nothing(tmp_path):
    planted = tmp_path / "planted"
    (planted / "comfy").mkdir(parents=True)
    marker = tmp_path / "imported"
    for name in ("__init__.py", "model_management.py", "cli_args.py"):
        (planted / "comfy" / name).write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    data = _spec(comfyui_path=str(planted))
    with pytest.raises(RunSpecError, match="unknown field.*comfyui_path"):
        spec_from_dict(data)
    spec = tmp_path / "run.toml"
    spec.write_text(f'run_dir = "{tmp_path}"\n[model]\npath = "/m/model.safetensors"\ncomfyui_path = "{planted}"\n'
                    f'[data]\nmanifest = "/d.json"\n[output]\nlora_path = "/o.safetensors"\n')
    proc = subprocess.run([sys.executable, str(REPO / "trainer"), "--config", str(spec)], capture_output=True,
                          text=True, timeout=120, cwd=planted)
    assert proc.returncode == 2 and "comfyui_path" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


def _upload(address: str, subfolder: str, name: str, data: bytes):
    """ComfyUI's stock upload route: any client can write any bytes anywhere under output/."""
    import requests
    reply = requests.post(f"http://{address}/upload/image", files={"image": (name, data)},
                          data={"type": "output", "subfolder": subfolder, "overwrite": "true"}, timeout=30)
    reply.raise_for_status()
    assert reply.json()["name"] == name


@pytest.mark.comfyui
def test_a_run_planted_through_the_upload_route_is_not_resumed(comfy, client, tmp_path):
    name = "planted_resume"
    run_id = "29990101-000000-planted_resume-dead"
    runs_dir = f"ingraph/runs/{run_id}"
    run_dir = comfy.base_dir / "output" / "ingraph" / "runs" / run_id
    marker = tmp_path / "pwned"
    code = f"open({str(marker)!r}, 'w').write('pwned')\n"
    for module in ("__init__.py", "model_management.py", "cli_args.py", "sd.py"):
        _upload(comfy.address, f"{runs_dir}/code/comfy", module, code.encode())
    spec = (f'version = 1\nrun_dir = "{run_dir}"\n[model]\npath = "{run_dir}/model.ckpt"\n'
            f'comfyui_path = "{run_dir}/code"\n[data]\nmanifest = "{run_dir}/dataset.json"\n'
            f'[train]\nsteps = 4\n[output]\nname = "{name}"\nlora_path = "{run_dir}/x.safetensors"\n')
    _upload(comfy.address, runs_dir, "run.toml", spec.encode())
    _upload(comfy.address, runs_dir, "dataset.json", b"{}")
    _upload(comfy.address, runs_dir, trust.RUN_SIGNATURE_FILE, json.dumps(
        {"version": 1, "run": run_id, "files": {}, "hmac": "0" * 64}).encode())
    tag = f"{runs_dir}/checkpoints/step_000002"
    _upload(comfy.address, tag, MODEL_FILE, pickle.dumps(_Payload(marker), protocol=2))
    _upload(comfy.address, tag, ckpt.STATE_FILE, b'{"step": 2}')
    _upload(comfy.address, tag, ckpt.COMPLETE_MARK, json.dumps(
        {"version": 1, "step": 2, "files": {}, "hmac": "0" * 64}).encode())
    assert (run_dir / "checkpoints" / "step_000002" / MODEL_FILE).is_file()  # the upload landed

    options = client.get("/object_info/InGraphTrainLoRA")["InGraphTrainLoRA"]["input"]["optional"]["resume"]
    assert "latest" in str(options) and run_id not in str(options)  # not offered as a checkpoint to resume

    wf = {k: v for k, v in load_workflow().items() if k in {"1", "2", "3", "4", "5", "6", "7"}}
    wf["6"]["inputs"].update(steps=1, output_name=name, resume="latest", precision="fp32")  # fp32: faster on CPU
    evaluate_on_one_image(wf)  # evaluation: not this test's point
    outcome = client.run(wf, timeout=300)
    assert outcome.ok, outcome.error
    events = [m["data"] for m in outcome.messages if m.get("type") == "ingraph.event"]
    assert events and all(e["run_id"] != run_id for e in events)
    started = [e["event"] for e in events if e["event"]["type"] == "started"]
    assert started and started[0]["start_step"] == 0 and started[0]["resumed_from"] is None
    assert not marker.exists()


def test_a_file_swapped_in_after_the_check_is_never_what_gets_loaded(tmp_path):
    """The window between checking and unpickling: a client overwrites the file in place once the check
    is done (ComfyUI's upload writes with open(path, "wb")); DeepSpeed must unpickle the checked bytes."""
    marker = tmp_path / "pwned"
    original = FakeEngine()
    path = save(original, tmp_path / "run", 4)

    class SwappingEngine(FakeEngine):
        def load_checkpoint(self, root, tag, **kwargs):
            plant_pickle(path / MODEL_FILE, marker, same_size=True)  # after the check, before the load
            return super().load_checkpoint(root, tag, **kwargs)

    assert ckpt.load_checkpoint(SwappingEngine(), path)["step"] == 4
    assert not marker.exists()
    with pytest.raises(Exception):  # the swap really happened: the live file is the planted pickle
        original.load_checkpoint(str(path.parent), path.name)
    assert marker.read_text() == "pwned"
