"""Generate distillation data and train a drafter on a lent accelerator, then bring the drafter back.

Some sessions are lent one H100 / H200 (the `device` tool: 15 minutes of device time, at most 10 per command,
jax 0.11 and no network there). In one 10-minute call it can answer ~10-100x more prompts than this 2-core CPU
does in a session and train on them. What stands in the way, and how this script gets round it:

- the machine is bare: it lacks `datasets` (with dill, multiprocess), `gguf` and `platformdirs`, so their
  wheels travel with the call (the versions installed here) and are installed into /tmp;
- a call carries at most 64 MiB, the working tree (~33 MiB, the shipped drafter included) counted in, and the
  target's GGUF is 94 MiB: the GGUF travels xz-compressed in parts, one per call, over back-to-back calls (the
  machine stays warm 30 s after each); every call runs the same command, which stages the parts it carries in
  /tmp and, once all are there, does the work;
- at most 8 files of <= 16 MiB come back: the float16 drafter (~29 MiB) comes back split, with its manifest.

Three steps:

    python -m tools.device_train pack                 # 1. here: .device/ and the calls, printed
    #   2. the printed `device run` calls, back to back; the last prints where its files landed (files_at)
    python -m tools.device_train unpack FILES_AT runs/snapshots/device_sNN     # 3. here: the drafter
    python -m tools.device_train dry-run              # steps 1-3 on this CPU at tiny sizes

The work in the last call (`device`): assemble and check the GGUF, `specdec data` with `data.max_seconds`, then
`specdec train` with `train.max_seconds` (the run ends evaluated and calibrated at its budget), a float16
snapshot, and the files for $OUT. The data answers are computed at full float32 precision
(JAX_DEFAULT_MATMUL_PRECISION=highest: they are the target's answers, as on the CPU); training uses the GPU's
default matmul precision. Whatever fails, the log and a device.json saying how far it got come back.

This module imports only the standard library at the top: on the device it runs before the wheels are in.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/train/device_h200.yaml"
PACK_DIR = ".device"  # ignored by .gitignore; each call carries some of its folders
CALL_LIMIT = 64 * 2**20  # what one call carries, the working tree included
CALL_MARGIN = 2**20  # kept free: the tree may grow a little between pack and the calls
OUT_FILE_LIMIT = 15 * 2**20  # files back: <= 16 MiB each, at most 8
WHEELS = ("datasets", "dill", "multiprocess", "gguf", "platformdirs")  # missing on the device image
PLAN = "plan.json"
MANIFEST = "device.json"
BUNDLE = "bundle.tar.gz"
PARAMS = "params.npz"
DATA_PREFIX = "${SPECDEC_DATA}"


class DeviceTrainError(RuntimeError):
    """A step of the device path that cannot go on (missing or corrupt part, failed job); the message says which."""


# ---------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    with open(path, "rb") as f:  # not registry.sha256_file: that module needs platformdirs, a carried wheel
        return hashlib.file_digest(f, "sha256").hexdigest()


def split_file(path: Path, out_dir: Path, part_bytes: int, prefix: str | None = None) -> list[dict]:
    """`path` cut into files of <= part_bytes named <prefix>.000, .001, ... in out_dir; their names, sizes and
    hashes, in order."""
    prefix = prefix or path.name
    parts = []
    with open(path, "rb") as f:
        while True:
            block = f.read(part_bytes)
            if parts and not block:  # the file ended with a full part (an empty file still gets one part)
                break
            part = out_dir / f"{prefix}.{len(parts):03d}"
            part.write_bytes(block)
            parts.append({"name": part.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
            if len(block) < part_bytes:
                break
    return parts


def join_parts(parts: list[dict], where: Path, dest: Path, expected_sha: str) -> None:
    """Concatenate `parts` (split_file's list) found in `where` into `dest`, checking each part and the whole."""
    tmp = dest.with_name(dest.name + ".partial")
    with open(tmp, "wb") as out:
        for part in parts:
            path = where / part["name"]
            if not path.is_file():
                raise DeviceTrainError(f"missing part {part['name']} in {where}")
            if sha256(path) != part["sha256"]:
                raise DeviceTrainError(f"part {path} is corrupt (SHA-256 differs from the manifest's)")
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    if sha256(tmp) != expected_sha:
        tmp.unlink()
        raise DeviceTrainError(f"{dest.name} joined from {len(parts)} parts has the wrong SHA-256")
    os.replace(tmp, dest)


def tree_bytes(repo: Path) -> int:
    """Bytes of what a call sends besides `carry`: tracked files and untracked files git does not ignore."""
    out = 0
    for args in (["ls-files", "-z"], ["ls-files", "-z", "-o", "--exclude-standard"]):
        names = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout
        for name in filter(None, names.decode().split("\0")):
            path = repo / name
            if path.is_file():
                out += path.stat().st_size
    return out


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------
# 1. pack (here)
# ---------------------------------------------------------------------------------------------------------

def _data_files(config: dict) -> list[str]:
    """The ${SPECDEC_DATA}/... files a train config reads (prompt files and decontamination lists)."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, str) and x.startswith(DATA_PREFIX + "/"):
            found.append(x[len(DATA_PREFIX) + 1:])

    walk(config.get("data", {}))
    return sorted(set(found))


def compressed_model(model: Path, cache: Path) -> Path:
    """The GGUF xz-compressed (94 MiB -> ~86 MiB: one call fewer), cached by the file's hash (~1.5 min once)."""
    digest = sha256(model)
    out = cache / f"{model.name}.{digest[:16]}.xz"
    if not out.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"compressing {model.name} (once; cached in {cache}) ...", flush=True)
        tmp = out.with_name(out.name + ".partial")
        with open(model, "rb") as src, lzma.open(tmp, "wb", preset=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, out)
    return out


def download_wheels(dest: Path) -> list[str]:
    """Wheels (Python 3.12, x86-64) of WHEELS at the versions installed here."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
           "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(dest), *pins]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise DeviceTrainError(f"pip download of {' '.join(pins)} failed:\n{done.stderr[-2000:]}")
    return pins


def plan_calls(model_bytes: int, common_bytes: int, room: int) -> list[int]:
    """Bytes of the model carried by each call: every call carries <= room; the last also carries the common
    folder (wheels, evaluation files). Fewest calls, the earlier ones full."""
    if room <= common_bytes:
        raise DeviceTrainError(f"a call has room for {room / 2**20:.1f} MiB beside the working tree, less than "
                               f"the {common_bytes / 2**20:.1f} MiB of wheels and data files: shrink the tree")
    sizes, left = [], model_bytes
    while left > room - common_bytes:
        sizes.append(min(room, left))
        left -= sizes[-1]
    sizes.append(left)
    return sizes


def pack(config: str = DEFAULT_CONFIG, out: Path = REPO / PACK_DIR, *, model_file: Path | None = None,
         room: int | None = None, wheels: bool = True, data_root: str | None = None) -> dict:
    """Write out/part<i>/ (model parts, plan.json) and out/common/ (wheels, data files, plan.json); returns the
    plan. `room`: bytes a call may carry beside the tree (default: 64 MiB - the tree - 1 MiB)."""
    import yaml

    from specdec.config import load_config, to_dict
    from specdec.models import registry

    cfg = load_config(config)
    model = Path(model_file) if model_file else registry.resolve(cfg.model.name)
    if not str(model).endswith(".gguf"):
        raise DeviceTrainError(f"model {cfg.model.name!r} is not a GGUF file ({model}): the device path carries one")
    shutil.rmtree(out, ignore_errors=True)
    common = out / "common"
    common.mkdir(parents=True)
    pins = download_wheels(common / "wheels") if wheels else []
    data_root = data_root or os.environ.get("SPECDEC_DATA")
    files = _data_files(to_dict(cfg))
    if files and not data_root:
        raise DeviceTrainError(f"{config} reads {', '.join(files)} under $SPECDEC_DATA: set SPECDEC_DATA")
    for rel in files:
        src = Path(data_root) / rel
        if not src.is_file():
            raise DeviceTrainError(f"{config} reads {DATA_PREFIX}/{rel}, and {src} does not exist")
        (common / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, common / "data" / rel)
    xz = compressed_model(model, registry.cache_dir() / "device")
    if room is None:
        room = CALL_LIMIT - tree_bytes(REPO) - CALL_MARGIN
    common_bytes = folder_bytes(common) + 8192  # + plan.json
    sizes = plan_calls(xz.stat().st_size, common_bytes, room)
    parts = []
    with open(xz, "rb") as f:
        for i, n in enumerate(sizes):
            block = f.read(n)
            (out / f"part{i}").mkdir()
            name = f"model.xz.{i:03d}"
            (out / f"part{i}" / name).write_bytes(block)
            parts.append({"name": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    plan = {"config": config, "model": cfg.model.name, "gguf": model.name, "gguf_sha256": sha256(model),
            "gguf_bytes": model.stat().st_size, "xz_sha256": sha256(xz), "parts": parts, "wheels": pins,
            "data_files": files, "room_bytes": room, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "config_text": yaml.safe_dump(to_dict(cfg), sort_keys=False)}
    for folder in [common] + [out / f"part{i}" for i in range(len(parts))]:
        (folder / PLAN).write_text(json.dumps(plan, indent=2))
    return plan


def calls(plan: dict, pack_dir: str = PACK_DIR, extra: str = "") -> list[dict]:
    """The `device run` calls that carry a pack: the same command each time, the common folder on the last."""
    n = len(plan["parts"])
    command = f"PYTHONUNBUFFERED=1 python3 -m tools.device_train device --out $OUT {extra}".strip()
    return [{"carry": [f"{pack_dir}/part{i}"] + ([f"{pack_dir}/common"] if i == n - 1 else []),
             "command": command, "timeout_s": 580 if i == n - 1 else 120} for i in range(n)]


# ---------------------------------------------------------------------------------------------------------
# 2. device (there; every call)
# ---------------------------------------------------------------------------------------------------------

def stage_parts(carried: Path, stage: Path) -> tuple[dict, list[str]]:
    """Copy the model parts this call carries into `stage` (checked against the plan); returns the plan and the
    parts still missing there. The common folder, when carried, is used where it is."""
    plans = sorted(carried.glob(f"*/{PLAN}"))
    if not plans:
        raise DeviceTrainError(f"this call carries no part of a pack: nothing under {carried}/*/{PLAN}; run "
                               "`python -m tools.device_train pack` here and carry its folders")
    plan = json.loads(plans[0].read_text())
    for other in plans[1:]:
        if json.loads(other.read_text())["xz_sha256"] != plan["xz_sha256"]:
            raise DeviceTrainError(f"{other} belongs to another pack than {plans[0]}: carry one pack's folders")
    stage.mkdir(parents=True, exist_ok=True)
    staged = stage / PLAN
    if staged.is_file() and json.loads(staged.read_text())["xz_sha256"] != plan["xz_sha256"]:
        for old in stage.glob("model.xz.*"):  # parts of an older pack: start over
            old.unlink()
    staged.write_text(json.dumps(plan))
    wanted = {p["name"]: p for p in plan["parts"]}
    for path in carried.glob("part*/model.xz.*"):
        part = wanted.get(path.name)
        if part is None or sha256(path) != part["sha256"]:
            raise DeviceTrainError(f"{path} is not a part of this pack or is corrupt (SHA-256 differs)")
        shutil.copyfile(path, stage / path.name)
    missing = [name for name in wanted if not (stage / name).is_file()]
    return plan, missing


def assemble_model(plan: dict, stage: Path, cache: Path) -> Path:
    """The GGUF, from the staged parts, where the registry looks for it ($SPECDEC_CACHE/models/<name>/)."""
    xz = stage / "model.xz"
    join_parts(plan["parts"], stage, xz, plan["xz_sha256"])
    dest = cache / "models" / plan["model"] / plan["gguf"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    with lzma.open(xz, "rb") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if sha256(tmp) != plan["gguf_sha256"]:
        tmp.unlink()
        raise DeviceTrainError(f"the decompressed {plan['gguf']} has the wrong SHA-256")
    os.replace(tmp, dest)
    xz.unlink()
    return dest


class Job:
    """A `specdec` command run as a child process with its output teed into a log, stopped with SIGTERM (which
    the training loop turns into a saved checkpoint) if it outlives `stop_at` (a time.monotonic() value)."""

    def __init__(self, args: list[str], env: dict, log, stop_at: float):
        self.args, self.env, self.log, self.stop_at = args, env, log, stop_at

    def run(self) -> int:
        import threading

        self.log(f"$ {' '.join(self.args)}")
        proc = subprocess.Popen(self.args, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, cwd=REPO)
        reader = threading.Thread(target=lambda: [self.log(line.rstrip("\n")) for line in proc.stdout], daemon=True)
        reader.start()
        try:
            proc.wait(timeout=max(self.stop_at - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            self.log(f"[device_train] the job outlived its budget: SIGTERM to {proc.pid} (a minute to save)")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
        return proc.returncode


def write_results(drafter_dir: Path, extra: list[Path], out: Path, manifest: dict) -> dict:
    """The drafter's params.npz split into <= 15 MiB files, everything else (its drafter.json, config, summary,
    and the `extra` files: logs, the data summary, metrics) in one tar.gz, and device.json: <= 8 files."""
    out.mkdir(parents=True, exist_ok=True)
    params = drafter_dir / PARAMS
    if params.is_file():
        manifest["params"] = {"sha256": sha256(params), "bytes": params.stat().st_size,
                              "parts": split_file(params, out, OUT_FILE_LIMIT, PARAMS)}
    with tarfile.open(out / BUNDLE, "w:gz") as tar:
        for path in sorted(drafter_dir.glob("*")) if drafter_dir.is_dir() else ():
            if path.is_file() and path.name != PARAMS:
                tar.add(path, arcname=f"drafter/{path.name}")
        for path in extra:
            if path.is_file():
                tar.add(path, arcname=f"device/{path.name}")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def device(args) -> int:
    """Stage the carried parts; when all are there, do the work and leave the results in --out."""
    t0 = time.monotonic()
    carried, stage = Path(args.carried), Path(args.stage)
    plan, missing = stage_parts(carried, stage)
    if missing:
        have = len(plan["parts"]) - len(missing)
        print(f"[device_train] staged {have} of {len(plan['parts'])} model parts in {stage}; still to carry: "
              f"{', '.join(missing)} (make the next call within 30 s, or the machine goes back and with it the "
              "staged parts)")
        return 0
    common = carried / "common"
    if not (common / PLAN).is_file():
        raise DeviceTrainError(f"all model parts are staged but this call does not carry the common folder "
                               f"({PACK_DIR}/common): carry it (with any part) to run")
    out = Path(args.out or stage / "out")
    out.mkdir(parents=True, exist_ok=True)
    log_path = stage / "device_log.txt"
    log_file = open(log_path, "w")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    manifest = {"plan": {k: v for k, v in plan.items() if k != "config_text"}, "reached": "staged",
                "budget_seconds": args.budget, "data_seconds": args.data_seconds, "train_seconds": args.train_seconds}
    deadline = t0 + args.budget
    env = {**os.environ, "SPECDEC_CACHE": str(stage / "cache"), "SPECDEC_DATA": str((common / "data").resolve()),
           "PYTHONUNBUFFERED": "1"}
    site = stage / "site"
    wheels = sorted((common / "wheels").glob("*.whl"))
    config = plan["config"]
    run_dir = drafter = None
    try:
        if wheels:
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                                   *map(str, wheels)], capture_output=True, text=True)
            if done.returncode != 0:
                raise DeviceTrainError(f"installing the carried wheels failed:\n{done.stderr[-2000:]}")
        paths = ([str(site)] if wheels else []) + [str(REPO), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        gguf = assemble_model(plan, stage, stage / "cache")
        manifest["reached"] = "model assembled"
        log(f"[device_train] {gguf} assembled and checked ({time.monotonic() - t0:.0f} s)")
        probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__, jax.devices())"],
                               env=env, capture_output=True, text=True)
        manifest["jax"] = (probe.stdout or probe.stderr).strip()[-500:]
        log(f"[device_train] jax: {manifest['jax']}")

        cli = [sys.executable, "-m", "experiments.cli"]
        sets = list(args.set or [])
        data_dir, output_dir, output_name = _settings(config, sets, env, "train.data_dir", "output.dir",
                                                      "output.name")
        t_data = time.monotonic()
        data_env = {**env, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}  # the target's own answers, as on the CPU
        rc = Job([*cli, "data", config, f"data.max_seconds={args.data_seconds}", *sets, "--no-progress"], data_env,
                 log, min(deadline - args.train_seconds - 60, t_data + args.data_seconds + 240)).run()
        manifest["data_wall_seconds"] = round(time.monotonic() - t_data, 1)
        summary = Path(data_dir) / "summary.json"
        if summary.is_file():
            manifest["data"] = json.loads(summary.read_text())
        if rc != 0 and not list(Path(data_dir).glob("shards/shard_?????")):
            raise DeviceTrainError(f"`specdec data` failed (exit {rc}) before writing any shard")
        manifest["reached"] = "data"

        t_train = time.monotonic()
        left = deadline - t_train - 45  # for the snapshot and the files
        train_seconds = max(min(args.train_seconds, left - 90), 10)  # 90 s: start-up, compile, final eval
        rc = Job([*cli, "train", config, f"train.max_seconds={train_seconds}", *sets, "--no-progress"], env, log,
                 t_train + left).run()
        manifest["train_wall_seconds"] = round(time.monotonic() - t_train, 1)
        run_dir = Path(output_dir) / output_name
        if (run_dir / "summary.json").is_file():
            train_summary = json.loads((run_dir / "summary.json").read_text())
            manifest["train"] = {k: v for k, v in train_summary.items() if k != "eval_history"}
        if rc != 0:
            log(f"[device_train] `specdec train` exited {rc}; snapshotting its newest checkpoint if any")
        drafter = stage / "drafter"
        shutil.rmtree(drafter, ignore_errors=True)
        snap = subprocess.run([sys.executable, "-m", "benchmarks.snapshot_drafter", str(run_dir), str(drafter),
                               "--float16"], env=env, capture_output=True, text=True, cwd=REPO)
        log(snap.stdout + snap.stderr)
        if snap.returncode != 0:
            raise DeviceTrainError(f"no drafter to bring back: the snapshot of {run_dir} failed")
        manifest["reached"] = "drafter"
        return 0
    except DeviceTrainError as e:
        log(f"[device_train] ERROR: {e}")
        manifest["error"] = str(e)
        return 1
    finally:
        manifest["wall_seconds"] = round(time.monotonic() - t0, 1)
        log(f"[device_train] reached: {manifest['reached']} in {manifest['wall_seconds']} s")
        log_file.close()
        extra = [log_path]
        if run_dir is not None:
            extra += [run_dir / "metrics.jsonl", run_dir / "summary.json"]
        data_summary = stage / "data_summary.json"
        if "data" in manifest:
            data_summary.write_text(json.dumps(manifest["data"], indent=2))
            extra.append(data_summary)
        write_results(drafter if drafter is not None else stage / "no_drafter", extra, out, manifest)
        print(f"[device_train] results in {out}: {sorted(p.name for p in out.iterdir())}", flush=True)


def _settings(config: str, sets: list[str], env: dict, *keys: str) -> list[str]:
    """Settings ("section.key") of the config after the --set overrides, read in one child process with the
    wheels' path (`env`): this process started before they were installed."""
    code = ("import json, sys; from specdec.config import load_config, to_dict; "
            "c = to_dict(load_config(sys.argv[1], sys.argv[3:])); "
            "print(json.dumps([c[s][k] for s, k in (key.split('.') for key in json.loads(sys.argv[2]))]))")
    done = subprocess.run([sys.executable, "-c", code, config, json.dumps(keys), *sets], capture_output=True,
                          text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise DeviceTrainError(f"cannot read {', '.join(keys)} of {config}: {done.stderr[-500:]}")
    return [str(v) for v in json.loads(done.stdout)]


# ---------------------------------------------------------------------------------------------------------
# 3. unpack (here)
# ---------------------------------------------------------------------------------------------------------

def unpack(files: Path, dest: Path) -> dict:
    """The drafter directory (drafter.json, params.npz, config.yaml, summary.json) from the files a last call
    brought back, and dest/device/ (its log, data summary, metrics). Returns the device manifest."""
    manifest_path = Path(files) / MANIFEST
    if not manifest_path.is_file():
        raise DeviceTrainError(f"{files} holds no {MANIFEST}: give the folder the last call's files landed in")
    manifest = json.loads(manifest_path.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(files) / BUNDLE, "r:gz") as tar:
        for member in tar.getmembers():
            top, _, name = member.name.partition("/")
            if not member.isfile() or top not in ("drafter", "device") or "/" in name or name.startswith("."):
                raise DeviceTrainError(f"unexpected member {member.name!r} in {BUNDLE}")
            target = dest / name if top == "drafter" else dest / "device" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    if "params" not in manifest:
        raise DeviceTrainError(f"the device run brought back no drafter (reached: {manifest.get('reached')}; "
                               f"error: {manifest.get('error')}); its log is in {dest / 'device'}")
    join_parts(manifest["params"]["parts"], Path(files), dest / PARAMS, manifest["params"]["sha256"])
    return manifest


# ---------------------------------------------------------------------------------------------------------
# dry run (here): the three steps on this CPU
# ---------------------------------------------------------------------------------------------------------

DRY_RUN_SETS = ["data.datasets.0.limit=16", "generation.batch_size=8", "generation.insert_rows=4",
                "generation.max_new_tokens=32", "train.shard_size=8", "train.batch_size=2", "train.steps=3",
                "train.eval_examples=2", "train.eval_every=2", "train.checkpoint_every=2", "train.seq_len=256",
                "train.length_buckets=[]"]


def dry_run(config: str, work: Path, room: int | None) -> dict:
    """pack -> each call in a folder holding only what it carries -> unpack, at tiny sizes, on this CPU."""
    work = Path(work)
    shutil.rmtree(work / "calls", ignore_errors=True)
    shutil.rmtree(work / "stage", ignore_errors=True)
    plan = pack(config, work / PACK_DIR, room=room, wheels=False)
    sets = " ".join(f"--set {shlex.quote(s)}" for s in DRY_RUN_SETS + [f"train.data_dir={work / 'data'}",
                                                          f"output.dir={work / 'runs'}"])
    todo = calls(plan, extra=f"--stage {work / 'stage'} --budget 400 --data-seconds 30 --train-seconds 20 {sets}")
    for i, call in enumerate(todo):
        where = work / "calls" / f"call{i}" / PACK_DIR
        for carried in call["carry"]:
            shutil.copytree(work / carried, where / Path(carried).name)
        out = work / "calls" / f"call{i}" / "OUT"
        cmd = call["command"].replace("$OUT", str(out)).replace("python3", sys.executable)
        cmd += f" --carried {where}"
        print(f"--- call {i + 1} of {len(todo)}: carry {call['carry']}", flush=True)
        done = subprocess.run(cmd, shell=True, cwd=REPO)
        if done.returncode != 0:
            raise DeviceTrainError(f"call {i + 1} failed (exit {done.returncode})")
    out = work / "calls" / f"call{len(todo) - 1}" / "OUT"
    files = sorted(out.iterdir())
    if len(files) > 8 or any(f.stat().st_size > 16 * 2**20 for f in files):
        raise DeviceTrainError(f"the files back break the limits (<= 8 files of <= 16 MiB): {files}")
    manifest = unpack(out, work / "drafter")
    from specdec.train import checkpoint as ckpt

    info = ckpt.load_drafter(work / "drafter")
    print(f"dry run: {len(todo)} calls; {len(files)} files back; drafter {info['drafter']} step {info['step']} "
          f"loads from {work / 'drafter'}")
    return manifest


# ---------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: write .device/ (model parts, wheels, data files) and print the calls")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--no-wheels", action="store_true", help="carry no wheels (a device that has the packages)")
    d = sub.add_parser("device", help="there (every call): stage the carried parts; with all of them, do the work")
    d.add_argument("--out", default=None, help="where the files to bring back go ($OUT there)")
    d.add_argument("--carried", default=PACK_DIR, help="the folder holding the carried pack folders")
    d.add_argument("--stage", default="/tmp/specdec_device", help="staged parts, model cache, wheels, the drafter")
    d.add_argument("--budget", type=float, default=540, help="seconds for the whole call (timeout_s is 580)")
    d.add_argument("--data-seconds", type=float, default=150, help="data.max_seconds (answers only)")
    d.add_argument("--train-seconds", type=float, default=180, help="train.max_seconds (less if time ran short)")
    d.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for data and train")
    u = sub.add_parser("unpack", help="here: the drafter directory from the files the last call brought back")
    u.add_argument("files", type=Path, help="the folder the last call's files landed in (files_at)")
    u.add_argument("dest", type=Path, help="the drafter directory to write")
    r = sub.add_parser("dry-run", help="here: pack, every call and unpack on this CPU, tiny sizes")
    r.add_argument("--config", default=DEFAULT_CONFIG)
    r.add_argument("--work", type=Path, default=Path("runs/device_dry_run"))
    r.add_argument("--room-mib", type=float, default=30.0,
                   help="MiB a call carries beside the tree (30: as on the device today)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            plan = pack(args.config, wheels=not args.no_wheels)
            todo = calls(plan)
            print(f"packed {plan['gguf']} into {len(plan['parts'])} parts under {PACK_DIR}/ "
                  f"({plan['room_bytes'] / 2**20:.1f} MiB per call beside the tree); make these calls back to back:")
            for i, call in enumerate(todo):
                print(f"  {i + 1}. run(carry={json.dumps(call['carry'])}, timeout_s={call['timeout_s']}, "
                      f"command={call['command']!r})")
            print("then: python -m tools.device_train unpack <files_at> runs/snapshots/<name>")
        elif args.cmd == "device":
            return device(args)
        elif args.cmd == "unpack":
            manifest = unpack(args.files, args.dest)
            train = manifest.get("train", {})
            print(f"wrote {args.dest}: step {train.get('steps')} ({train.get('status')}), final eval "
                  f"{(train.get('final_eval') or {}).get('expected_tau')}; device log in {args.dest / 'device'}")
        else:
            dry_run(args.config, args.work, int(args.room_mib * 2**20))
    except DeviceTrainError as e:
        raise SystemExit(f"error: {e}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
