"""Run distillation data and training jobs on a lent accelerator, then bring the results back.

Some sessions are lent a machine with an accelerator (the `device` tool: a TPU v5e chip or a GPU, ~30 minutes
of device time, at most 10 per command, no network there). What stands in the way, and how this script gets
round it:

- the machine is bare: the packages specdec needs come from its own package index (a TPU machine's, pinned to
  the JAX it has), or travel as wheels (`pack` without --no-wheels: the versions installed here), into a folder
  that goes last on PYTHONPATH;
- a call carries at most 64 MiB, the working tree (~32 MiB, the shipped drafter included) counted in, and the
  target's GGUF is 94 MiB: the GGUF travels xz-compressed in parts, one per call, over back-to-back calls (the
  machine stays warm ~100 s after each); every call runs the same command, which stages the parts it carries in
  /tmp and, once all are there, does the work;
- at most 8 files of <= 16 MiB come back: each drafter comes back in float16 parts, as many as fit a call.

The work is a study file's jobs (`load_study`: `specdec data` / `specdec train` of configs with overrides, each
with its time budget) or, for a plain config, its data and its training. The job model (a study's jobs, a job's
command, where it writes, whether it finished) is the recipe runner's, experiments/recipe.py. A call that runs
out of time leaves the jobs it did not reach to the next call with the same command.

    python -m tools.device_train pack --config CONFIG_OR_STUDY [--no-wheels]   # 1. here: .device/, the calls
    #   2. the printed `device run` calls, back to back (then more with .device/common alone, to go on)
    python -m tools.device_train unpack FILES_AT runs/snapshots/<name>      # 3. here: drafters and results
    python -m tools.device_train dry-run --config CONFIG_OR_STUDY           # steps 1-3 on this CPU, tiny sizes

Data jobs compute the target's answers at full float32 precision (JAX_DEFAULT_MATMUL_PRECISION=highest: they
are the target's answers, as on the CPU); training uses the accelerator's default matmul precision. Whatever
fails, the log and a device.json saying how far it got come back.

This module imports only the standard library at the top: on the device it runs before the packages are in.
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

from experiments import recipe  # standard library only at its top, like this module

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/train/device_h200.yaml"
PACK_DIR = ".device"  # ignored by .gitignore; each call carries some of its folders
CALL_LIMIT = 64 * 2**20  # what one call carries, the working tree included
CALL_MARGIN = 2**20  # kept free: the tree may grow a little between pack and the calls
OUT_FILE_LIMIT = 15 * 2**20  # files back: <= 16 MiB each, at most 8
BRING_BACK_BYTES = 56 * 2**20  # drafters' params in one call's files back (64 MiB in all, the bundle beside them)
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


def load_study(path: str) -> dict:
    """The work of the device call as {"jobs": [...], "bring_back": [...]}: a study file's jobs, or a plain
    config's data and train job (`experiments.recipe.load_study`, the recipe format's data and train jobs)."""
    try:
        return recipe.load_study(path)
    except recipe.RecipeError as e:
        raise DeviceTrainError(str(e)) from None


def pack(config: str = DEFAULT_CONFIG, out: Path = REPO / PACK_DIR, *, model_file: Path | None = None,
         room: int | None = None, wheels: bool = True, data_root: str | None = None) -> dict:
    """Write out/part<i>/ (model parts, plan.json) and out/common/ (wheels, data files, plan.json); returns the
    plan. `config`: a train config or a study file (`load_study`). `room`: bytes a call may carry beside the
    tree (default: 64 MiB - the tree - 1 MiB)."""
    import yaml

    from specdec.config import load_config, to_dict
    from specdec.models import registry

    study = load_study(config)
    cfgs = [load_config(job["config"], job["set"]) for job in study["jobs"]]
    if len({c.model.name for c in cfgs}) != 1:
        raise DeviceTrainError(f"{config}: the jobs use several models ({sorted({c.model.name for c in cfgs})}); "
                               "a pack carries one")
    cfg = cfgs[0]
    outputs = [c.output.name or Path(job["config"]).stem
               for c, job in zip(cfgs, study["jobs"]) if job["run"] == "train"]
    unknown = [name for name in study["bring_back"] or () if name not in outputs]
    if unknown:  # here, not after the device call has run every job
        raise DeviceTrainError(f"{config}: bring_back names {', '.join(unknown)}, which no train job writes "
                               f"({', '.join(outputs)})")
    model = Path(model_file) if model_file else registry.resolve(cfg.model.name)
    if not str(model).endswith(".gguf"):
        raise DeviceTrainError(f"model {cfg.model.name!r} is not a GGUF file ({model}): the device path carries one")
    shutil.rmtree(out, ignore_errors=True)
    common = out / "common"
    common.mkdir(parents=True)
    pins = download_wheels(common / "wheels") if wheels else []
    data_root = data_root or os.environ.get("SPECDEC_DATA")
    files = sorted({f for c in cfgs for f in _data_files(to_dict(c))})
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
            "study": study, "config_text": yaml.safe_dump(to_dict(cfg), sort_keys=False)}
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

    def __init__(self, args: list[str], env: dict, log, stop_at: float, cwd: Path = REPO):
        self.args, self.env, self.log, self.stop_at, self.cwd = args, env, log, stop_at, cwd

    def run(self) -> int:
        import threading

        self.log(f"$ {' '.join(self.args)}")
        proc = subprocess.Popen(self.args, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, cwd=self.cwd)
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


def write_results(drafters: dict[str, Path], extra: list[Path], out: Path, manifest: dict) -> dict:
    """Each drafter's params.npz split into <= 15 MiB files named <drafter>.params.npz.NNN, everything else
    (their drafter.json, config, summary, and the `extra` files: logs, summaries, metrics) in one tar.gz, and
    device.json: <= 8 files when the drafters fit (size `bring_back` so)."""
    out.mkdir(parents=True, exist_ok=True)
    manifest["drafters"] = []
    with tarfile.open(out / BUNDLE, "w:gz") as tar:
        for name, drafter_dir in drafters.items():
            params = drafter_dir / PARAMS
            if not params.is_file():
                continue
            manifest["drafters"].append({"name": name, "sha256": sha256(params), "bytes": params.stat().st_size,
                                         "parts": split_file(params, out, OUT_FILE_LIMIT, f"{name}.{PARAMS}")})
            for path in sorted(drafter_dir.glob("*")):
                if path.is_file() and path.name != PARAMS:
                    tar.add(path, arcname=f"drafter/{name}/{path.name}")
        for path in extra:
            if path.is_file():
                tar.add(path, arcname=f"device/{path.name}")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


INDEX = Path("/opt/pypi/simple")  # a TPU machine's own package index (no network there)
NEEDED = ("flax", "optax", "orbax-checkpoint", "datasets", "tokenizers", "tqdm", "gguf", "platformdirs",
          "safetensors")  # what `specdec data` / `specdec train` import beyond jax, numpy, yaml and jinja2
IMPORTS = "import flax, optax, orbax.checkpoint, datasets, tokenizers, tqdm, gguf, platformdirs, safetensors, yaml"


def install_packages(wheels: list[Path], site: Path, env: dict) -> str:
    """Make NEEDED importable: the carried wheels, else the machine's own index, into `site`, which goes last on
    PYTHONPATH so the machine's JAX stays the one imported. Returns what was done."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", ""), str(site)]))
    if subprocess.run([sys.executable, "-c", IMPORTS], env=env, capture_output=True).returncode == 0:
        return "already importable"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--isolated", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site)]
    if wheels:
        cmd, how = pip + ["--no-index", "--no-deps", *map(str, wheels)], "carried wheels"
    elif INDEX.is_dir():  # pin what the machine has, so the index brings no other JAX or numpy beside it
        have = subprocess.run([sys.executable, "-c", "import jax, jaxlib, numpy; print(jax.__version__, "
                               "jaxlib.__version__, numpy.__version__)"], env=env, capture_output=True, text=True)
        pins = [f"{n}=={v}" for n, v in zip(("jax", "jaxlib", "numpy"), have.stdout.split())]
        cmd = pip + ["--only-binary=:all:", "--index-url", INDEX.as_uri(), *NEEDED, *pins]
        how = f"the machine's index ({', '.join(pins)})"
    else:
        raise DeviceTrainError(f"cannot import what specdec needs here, and neither wheels were carried nor is "
                               f"there a package index at {INDEX}")
    done = subprocess.run(cmd, env={**env, "PIP_CONFIG_FILE": os.devnull}, capture_output=True, text=True)
    if done.returncode != 0:
        raise DeviceTrainError(f"installing {', '.join(NEEDED)} from {how} failed:\n{done.stderr[-2000:]}")
    check = subprocess.run([sys.executable, "-c", IMPORTS], env=env, capture_output=True, text=True)
    if check.returncode != 0:
        raise DeviceTrainError(f"installed from {how}, yet the imports fail:\n{check.stderr[-2000:]}")
    return f"installed from {how}"


def device(args) -> int:
    """Stage the carried parts; when all are there, run the plan's jobs and leave the results in --out. A call
    that runs out of time leaves the jobs it did not reach for the next call with the same command (data and
    training resume; finished training runs are skipped)."""
    t0 = time.monotonic()
    carried, stage = Path(args.carried), Path(args.stage)
    plan, missing = stage_parts(carried, stage)
    if missing:
        have = len(plan["parts"]) - len(missing)
        print(f"[device_train] staged {have} of {len(plan['parts'])} model parts in {stage}; still to carry: "
              f"{', '.join(missing)} (make the next call while the machine is warm, or it goes back and with it "
              "the staged parts)")
        return 0
    common = carried / "common"
    if not (common / PLAN).is_file():
        raise DeviceTrainError(f"all model parts are staged but this call does not carry the common folder "
                               f"({PACK_DIR}/common): carry it (with any part) to run")
    out = Path(args.out or stage / "out")
    out.mkdir(parents=True, exist_ok=True)
    log_path = stage / "device_log.txt"
    log_file = open(log_path, "a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    study = plan.get("study") or load_study(plan["config"])
    manifest = {"plan": {k: v for k, v in plan.items() if k != "config_text"}, "reached": "staged",
                "budget_seconds": args.budget, "jobs": []}
    deadline = t0 + args.budget
    env = {**os.environ, "SPECDEC_CACHE": str(stage / "cache"), "SPECDEC_DATA": str((common / "data").resolve()),
           "PYTHONUNBUFFERED": "1"}
    sets = list(args.set or [])
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    results = stage / "results"
    results.mkdir(exist_ok=True)
    brought: dict[str, Path] = {}
    try:
        manifest["packages"] = install_packages(sorted((common / "wheels").glob("*.whl")), stage / "site", env)
        log(f"[device_train] packages: {manifest['packages']} ({time.monotonic() - t0:.0f} s)")
        gguf = stage / "cache" / "models" / plan["model"] / plan["gguf"]
        if not (gguf.is_file() and sha256(gguf) == plan["gguf_sha256"]):
            gguf = assemble_model(plan, stage, stage / "cache")
        manifest["reached"] = "model assembled"
        log(f"[device_train] {gguf} assembled and checked ({time.monotonic() - t0:.0f} s)")
        probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__, jax.devices())"],
                               env=env, capture_output=True, text=True)
        manifest["jax"] = (probe.stdout or probe.stderr).strip()[-500:]
        log(f"[device_train] jax: {manifest['jax']}")

        cli = [sys.executable, "-m", "experiments.cli"]
        defaults = {"data": args.data_seconds, "train": args.train_seconds}
        ran_file = stage / "jobs_ran.json"  # jobs an earlier call started
        ran = set(json.loads(ran_file.read_text())) if ran_file.is_file() else set()
        # where each job writes: read once (each read is a Python process with the config system)
        def settings(config, job_sets, *keys):  # in a child process: this one started before the wheels
            return _settings(str(REPO / config), job_sets, env, *keys)

        job_paths = [recipe.job_paths(job, sets, workdir, settings) for job in study["jobs"]]
        for i, (job, paths) in enumerate(zip(study["jobs"], job_paths)):
            record = {"job": i, "run": job["run"], "config": job["config"], "name": paths["name"]}
            manifest["jobs"].append(record)
            if recipe.finished(job, paths, ran_before=i in ran):
                record["status"] = "done in an earlier call"
                continue
            left = deadline - time.monotonic() - 60  # for the snapshots and the files
            wanted = job["seconds"] or defaults[job["run"]]
            seconds = min(wanted, left - 60)  # 60: start-up, compile, last eval
            # a train job cut to less than half its budget would spend its start-up and compilation for little:
            # it waits for the next call
            if seconds < 20 or (job["run"] == "train" and seconds < wanted / 2):
                record["status"] = "not reached: the call's time ran out (the same call again goes on)"
                log(f"[device_train] job {i} ({job['run']} {paths['name']}): {record['status']}")
                continue
            ran.add(i)
            ran_file.write_text(json.dumps(sorted(ran)))
            # the target's answers at full float32 precision, as on the CPU
            job_env = {**env, "JAX_DEFAULT_MATMUL_PRECISION": "highest"} if job["run"] == "data" else env
            t_job = time.monotonic()
            rc = Job([*cli, *recipe.job_args(job, *sets, f"{job['run']}.max_seconds={seconds:.0f}", "--no-progress")],
                     job_env, log, min(t_job + seconds + 180, deadline - 45), cwd=workdir).run()
            record.update(rc=rc, wall_seconds=round(time.monotonic() - t_job, 1), budget_seconds=round(seconds))
            summary = (paths["data_dir"] if job["run"] == "data" else paths["run_dir"]) / "summary.json"
            if summary.is_file():
                shutil.copyfile(summary, results / f"{paths['name']}.{job['run']}_summary.json")
                record["status"] = json.loads(summary.read_text()).get("status", "written")
            else:
                record["status"] = f"exit {rc}, no summary"
            if job["run"] == "train" and (paths["run_dir"] / "metrics.jsonl").is_file():
                shutil.copyfile(paths["run_dir"] / "metrics.jsonl", results / f"{paths['name']}.metrics.jsonl")
            log(f"[device_train] job {i} ({job['run']} {paths['name']}): {record['status']} in "
                f"{record['wall_seconds']} s")
        manifest["reached"] = "jobs"

        train_jobs = {p["name"]: p for j, p in zip(study["jobs"], job_paths) if j["run"] == "train"}
        wanted = study["bring_back"] if study["bring_back"] is not None else list(train_jobs)[-1:]
        done_file = stage / "brought_back.json"  # drafters an earlier call already brought back
        done = json.loads(done_file.read_text()) if done_file.is_file() else []
        room = BRING_BACK_BYTES
        for name in wanted:  # each a train job's output name (`pack` checked)
            if name in done or not recipe.finished({"run": "train"}, train_jobs[name]):
                continue
            dest = stage / "drafters" / name
            shutil.rmtree(dest, ignore_errors=True)
            snap = subprocess.run([sys.executable, "-m", "benchmarks.snapshot_drafter",
                                   str(train_jobs[name]["run_dir"]), str(dest), "--float16"], env=env,
                                  capture_output=True, text=True, cwd=REPO)
            log(snap.stdout + snap.stderr)
            if snap.returncode != 0:
                continue
            size = (dest / PARAMS).stat().st_size
            if size > room:
                log(f"[device_train] {name} ({size / 2**20:.1f} MiB) does not fit this call's files: the next "
                    "call with the same command brings it")
                break
            room -= size
            brought[name] = dest
        done_file.write_text(json.dumps(done + list(brought)))
        manifest["reached"] = "drafters" if brought else manifest["reached"]
        return 0
    except DeviceTrainError as e:
        log(f"[device_train] ERROR: {e}")
        manifest["error"] = str(e)
        return 1
    finally:
        manifest["wall_seconds"] = round(time.monotonic() - t0, 1)
        log(f"[device_train] reached: {manifest['reached']} in {manifest['wall_seconds']} s")
        log_file.close()
        write_results(brought, [log_path, *sorted(results.glob("*"))], out, manifest)
        print(f"[device_train] results in {out}: {sorted(p.name for p in out.iterdir())}", flush=True)


def _settings(config: str, sets: list[str], env: dict, *keys: str) -> list:
    """`recipe.read_settings` (settings "section.key" of the config after the --set overrides) in one child
    process with the wheels' path (`env`): this process started before they were installed."""
    code = ("import json, sys; from experiments.recipe import read_settings; "
            "print(json.dumps(read_settings(sys.argv[1], sys.argv[3:], *json.loads(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", code, config, json.dumps(keys), *sets], capture_output=True,
                          text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise DeviceTrainError(f"cannot read {', '.join(keys)} of {config}: {done.stderr[-500:]}")
    return json.loads(done.stdout)


# ---------------------------------------------------------------------------------------------------------
# 3. unpack (here)
# ---------------------------------------------------------------------------------------------------------

def unpack(files: Path, dest: Path) -> dict:
    """dest/<drafter>/ (drafter.json, params.npz, config.yaml, summary.json) for each drafter the last call
    brought back, and dest/device/ (its log, the runs' summaries and metrics). Returns the device manifest."""
    manifest_path = Path(files) / MANIFEST
    if not manifest_path.is_file():
        raise DeviceTrainError(f"{files} holds no {MANIFEST}: give the folder the last call's files landed in")
    manifest = json.loads(manifest_path.read_text())
    names = {d["name"] for d in manifest.get("drafters", [])}
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(files) / BUNDLE, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            ok = member.isfile() and not any(p.startswith(".") or not p for p in parts) and (
                (parts[0] == "drafter" and len(parts) == 3 and parts[1] in names)
                or (parts[0] == "device" and len(parts) == 2))
            if not ok:
                raise DeviceTrainError(f"unexpected member {member.name!r} in {BUNDLE}")
            target = dest / parts[1] / parts[2] if parts[0] == "drafter" else dest / "device" / parts[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    if not names and not manifest.get("jobs"):
        raise DeviceTrainError(f"the device run brought back no drafter (reached: {manifest.get('reached')}; "
                               f"error: {manifest.get('error')}); its log is in {dest / 'device'}")
    for d in manifest.get("drafters", []):
        join_parts(d["parts"], Path(files), dest / d["name"] / PARAMS, d["sha256"])
    return manifest


# ---------------------------------------------------------------------------------------------------------
# dry run (here): the three steps on this CPU
# ---------------------------------------------------------------------------------------------------------

DRY_RUN_SETS = ["data.datasets.0.limit=16", "generation.batch_size=8", "generation.insert_rows=4",
                "generation.max_new_tokens=32", "train.shard_size=8", "train.batch_size=2", "train.steps=3",
                "train.eval_examples=2", "train.eval_every=2", "train.checkpoint_every=2", "train.seq_len=256",
                "train.length_buckets=[]"]


def dry_run(config: str, work: Path, room: int | None, more_sets: tuple[str, ...] = ()) -> dict:
    """pack -> each call in a folder holding only what it carries -> unpack, at tiny sizes, on this CPU."""
    work = Path(work)
    shutil.rmtree(work / "calls", ignore_errors=True)
    shutil.rmtree(work / "stage", ignore_errors=True)
    plan = pack(config, work / PACK_DIR, room=room, wheels=False)
    shutil.rmtree(work / "jobs", ignore_errors=True)
    sets = " ".join(f"--set {shlex.quote(s)}" for s in DRY_RUN_SETS + list(more_sets))
    todo = calls(plan, extra=f"--stage {work / 'stage'} --workdir {work / 'jobs'} --budget 900 --data-seconds 30 "
                             f"--train-seconds 20 {sets}")
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
    manifest = unpack(out, work / "drafters")
    from specdec.train import checkpoint as ckpt

    for d in manifest["drafters"]:
        info = ckpt.load_drafter(work / "drafters" / d["name"])
        print(f"dry run: drafter {info['drafter']} step {info['step']} loads from {work / 'drafters' / d['name']}")
    print(f"dry run: {len(todo)} calls; {len(files)} files back; jobs: "
          f"{[(j['name'], j.get('status')) for j in manifest['jobs']]}")
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
    d.add_argument("--workdir", default=str(REPO), help="where the jobs run: their relative output paths (runs/...) "
                   "land under it")
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
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="more config overrides for every job")
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
            for job in manifest["jobs"]:
                print(f"  job {job['job']}: {job['run']} {job['name']}: {job.get('status')}")
            print(f"wrote {args.dest}: drafters {[d['name'] for d in manifest['drafters']]}; the runs' summaries, "
                  f"metrics and the device log in {args.dest / 'device'}")
        else:
            dry_run(args.config, args.work, int(args.room_mib * 2**20), tuple(args.set or ()))
    except DeviceTrainError as e:
        raise SystemExit(f"error: {e}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
