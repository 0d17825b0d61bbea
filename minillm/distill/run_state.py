"""A distillation run's own state beside chapter 02's checkpoints, so that an interrupted run resumes exactly.

What it adds: chapter 02's trainer saves and resumes the weights, AdamW, the RNGs and its own history atomically
(`minillm.gpt.train_state`); a distillation run has two things more that the trainer does not know about, and
this module keeps them in the run directory (`TrainConfig.out_dir`) next to the checkpoints:

    distill_run.json        the settings (T, w, kind, β, the teacher's weights digest, grad_accum, the student it
                            started from), `first_serial`, the serial the run's first checkpoint gets, and the
                            sha256 of all of them (a hand edit is refused on resume)
    distill_records.jsonl   one line per call of the objective (its hard, soft, feature and total terms), appended
                            and fsynced before that step's checkpoint can exist; each line's "sha256" chains it to
                            the line before (the first to distill_run.json's sha256): an edited, dropped or
                            reordered line is refused on resume (`record_digest`)

Resume (`resume_run`) takes the checkpoint the trainer will take (`find_checkpoint`), refuses settings that differ
from the interrupted run's (a different T or teacher would silently continue another run), refuses a checkpoint
older than the run (a fresh run killed before its first save leaves the previous run's checkpoint as the newest),
and keeps the first step · grad_accum records, the ones that belong to the checkpoint's steps; lines written after
it (a step that ran but was never saved) are dropped. Both files are checked field by field first (`_check_run`,
`check_record`): a damaged one is a ValueError naming the file, the line and the field, before any training step.
JSON keeps a float's shortest repr, so the records read back are the very floats that were written, and the resumed
run's log equals the uninterrupted one's.

What it leaves out: a learned feature projection's weights and AdamW state (the trainer refuses to resume a loss
with parameters of its own; `distill` says so up front).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from minillm.core.config import (check_bool, check_float, check_int, check_label, check_module_has_data, number_kind,
                                 plain_number, short_repr)
from minillm.core.io import (
    SHA256_FIELD,
    atomic_write_text,
    check_output_dir,
    check_output_file,
    check_path,
    content_sha256,
    read_json_file,
)
from minillm.core.model import GPT, require_model
from minillm.distill.losses import check_kind, check_temperature
from minillm.gpt.train_state import find_checkpoint

RUN_NAME = "distill_run.json"
RECORDS_NAME = "distill_records.jsonl"
RUN_FORMAT = "minillm-distill-run"
SETTINGS = ("temperature", "kd_weight", "kind", "feature_weight", "teacher_sha256", "grad_accum", "trainer")
# The trainer's settings that decide what a run computes (its TrainConfig fields): a resume with another lr, batch,
# seed or schedule would finish a different run than the one interrupted. Not max_minutes (a budget, not the run).
TRAINER_FIELDS = ("corpus", "tokenizer", "steps", "batch_size", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
                  "beta1", "beta2", "grad_clip", "dropout", "seed", "amp")
RECORD_KEYS = ("hard", "soft", "total")  # what every call of DistillObjective records ("feature" too, with features)


def record_keys(feature_weight: float) -> tuple[str, ...]:
    """The fields of one record of an objective with this feature weight (a finite number >= 0, else a TypeError /
    ValueError naming feature_weight: NaN compared False with 0 and gave the records without "feature")."""
    feature_weight = check_float("feature_weight", feature_weight, 0.0)
    return ("hard", "soft", "feature", "total") if feature_weight > 0 else RECORD_KEYS


def _fields_problem(d: dict, keys: tuple[str, ...]) -> str:
    """"" when dict d holds exactly `keys`, else what is wrong: " (missing [...])", " (unexpected [...])" or both."""
    missing, extra = [k for k in keys if k not in d], sorted(set(d) - set(keys), key=str)
    return (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else "")


def check_keys(keys: object) -> tuple[str, ...]:
    """A record's field names (`record_keys`): a non-empty tuple of str; a TypeError naming keys otherwise (a str
    would be read as its letters)."""
    if not isinstance(keys, tuple) or not keys or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"keys must be a record's field names (a non-empty tuple of str, `record_keys`), got "
                        f"{short_repr(keys)}")
    return keys


def check_record(record: object, keys: tuple[str, ...], where: str) -> dict[str, float]:
    """`record` a dict with exactly the fields `keys`, each a real number (+inf and NaN included: a loss can be
    either, and the log keeps what was computed; an int within the float range); a ValueError naming `where` (a file
    and line, or `objective.records[3]`) and the field otherwise. `kd_history` averages these fields: a missing one
    would be a KeyError, an int past the float range an OverflowError, after the whole run."""
    where = check_label("where", where)
    check_keys(keys)
    if not isinstance(record, dict):
        raise ValueError(f"{where} must be a record (an object with fields {list(keys)}), got "
                         f"{type(record).__name__} {short_repr(record)}")
    if problem := _fields_problem(record, keys):
        raise ValueError(f"{where} must have the fields {list(keys)}, got {sorted(record, key=str)}{problem}")
    for k in keys:
        v = record[k]
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"{where}: field {short_repr(k)} must be a number, got {number_kind(v)}")
        v = plain_number(v)  # an int subclass's own abs() is not consulted
        if isinstance(v, int) and abs(v) > sys.float_info.max:  # no repr: str() of a 4300-digit int is an error
            raise ValueError(f"{where}: field {short_repr(k)} must be within the float range, got an int of "
                             f"{v.bit_length()} bits")
    return record


def check_settings(settings: object) -> dict[str, Any]:
    """`settings` a dict with exactly the fields of SETTINGS, each what `distill` itself passes: temperature in
    [1e-2, 1e4], kd_weight in [0, 1], kind "forward" or "reverse", feature_weight >= 0 (finite floats), grad_accum
    an int >= 1, teacher_sha256 a SHA-256 hex digest or None, and trainer the TRAINER_FIELDS of the run's
    TrainConfig (JSON scalars). A TypeError / ValueError naming the field otherwise,
    before anything is written or compared: a run written with settings missing a field could never be resumed
    (`resume_run` compares every one), and one with a wrong value would be resumed as a run it never was."""
    if not isinstance(settings, dict):
        raise TypeError(f"settings must be a dict of the run's settings {list(SETTINGS)}, got "
                        f"{type(settings).__name__} {short_repr(settings)}")
    if problem := _fields_problem(settings, SETTINGS):
        raise ValueError(f"settings must hold exactly the fields {list(SETTINGS)}{problem}")
    settings = dict(settings)  # a copy holding the plain numbers the checks return (what is written and compared)
    settings["temperature"] = check_temperature(settings["temperature"])
    settings["kd_weight"] = check_float("kd_weight", settings["kd_weight"], 0.0, 1.0)
    settings["kind"] = check_kind(settings["kind"])  # the plain str: compared on resume
    settings["feature_weight"] = check_float("feature_weight", settings["feature_weight"], 0.0)
    settings["grad_accum"] = check_int("grad_accum", settings["grad_accum"])
    digest = settings["teacher_sha256"]
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64
                                   and all(c in "0123456789abcdef" for c in digest)):
        raise ValueError(f"settings field 'teacher_sha256' must be a SHA-256 hex digest (teacher_digest) or None, "
                         f"got {short_repr(digest)}")
    if digest is not None:
        settings["teacher_sha256"] = str.__str__(digest)  # the plain str, as the others
    trainer = settings["trainer"]
    if not isinstance(trainer, dict) or set(trainer) != set(TRAINER_FIELDS):
        raise ValueError(f"settings field 'trainer' must be an object of the trainer's fields {list(TRAINER_FIELDS)}, "
                         f"got {short_repr(trainer)}")
    for key, value in trainer.items():
        if not (value is None or type(value) in (str, int, float, bool)):  # JSON's scalars, compared on resume
            raise TypeError(f"settings['trainer'][{key!r}] must be a str, number, bool or None, got "
                            f"{type(value).__name__}")
    settings["trainer"] = dict(trainer)
    return settings


def _check_run(run: object, run_path: Path) -> dict[str, Any]:
    """distill_run.json's content: the format tag, a `settings` object, `first_serial` an int >= 1,
    `student_init` a path or null, and a "sha256" field that matches the rest (`content_sha256`); a ValueError naming
    the file and the field otherwise (a damaged or hand-edited file is named before any training step, not met as a
    KeyError or a TypeError halfway through resuming, nor resumed with a student_init the run never had)."""
    if not isinstance(run, dict) or run.get("format") != RUN_FORMAT:
        raise ValueError(f"{str(run_path)!r} is not a {RUN_FORMAT!r} file")
    if not isinstance(run.get("settings"), dict):
        raise ValueError(f"{str(run_path)!r}: field 'settings' must be an object of the run's settings {list(SETTINGS)}"
                         f", got {short_repr(run.get('settings'))}")
    serial = run.get("first_serial")
    if not isinstance(serial, int) or isinstance(serial, bool) or serial < 1:
        raise ValueError(f"{str(run_path)!r}: field 'first_serial' must be an int >= 1, got "
                         f"{type(serial).__name__} {short_repr(serial)}")
    if not (run.get("student_init") is None or isinstance(run.get("student_init"), str)):
        raise ValueError(f"{str(run_path)!r}: field 'student_init' must be a path or null, got "
                         f"{short_repr(run.get('student_init'))}")
    if run.get(SHA256_FIELD) != content_sha256({}, run):  # a field edited by hand (student_init: the log's record)
        raise ValueError(f"{str(run_path)!r}: the content does not match its field {SHA256_FIELD!r} (edited or "
                         "damaged after the run wrote it): its settings, student_init and first_serial can no longer "
                         "be trusted; start the run again")
    return run


def teacher_digest(teacher: GPT | None) -> str | None:
    """SHA-256 of the teacher's weights (names, dtypes, shapes, bytes): a resume must distil from the same teacher.
    A teacher on the meta device has no bytes to hash: a ValueError naming the tensor."""
    if teacher is None:
        return None
    require_model(teacher, "teacher_digest (teacher)")
    check_module_has_data("teacher", teacher)
    return content_sha256(dict(teacher.state_dict()))


def check_digest(name: str, digest: object) -> str:
    """A digest the records chain from: a str of 64 lowercase hex digits (a line's or distill_run.json's sha256), or
    '' (a log with nothing before it); the plain str, or a TypeError / ValueError naming `name`."""
    if not isinstance(digest, str):
        raise TypeError(f"{name} must be a sha256 digest (a str), got {type(digest).__name__}")
    if not re.fullmatch(r"|[0-9a-f]{64}", str.__str__(digest)):
        raise ValueError(f"{name} must be a sha256 digest (64 lowercase hex digits) or '', got {short_repr(digest)}")
    return str.__str__(digest)


def record_digest(previous: str, record: dict[str, float]) -> str:
    """The "sha256" field of a records line: SHA-256 of the previous line's digest (distill_run.json's for the
    first line) and the record's JSON. A chain: editing, dropping or reordering a line breaks every digest after it,
    so a resumed run never reads a loss value the run did not compute (JSON keeps a float's shortest repr: the
    record read back dumps to the very same text). `record` is checked as a record of the fields it holds
    (`check_record`: numbers within the float range) and `previous` as a str, naming them otherwise."""
    check_digest("previous", previous)
    if isinstance(record, dict) and not all(isinstance(k, str) for k in record):  # JSON's keys are strings
        raise TypeError(f"record's field names must be str, got {sorted(map(short_repr, record))}")
    if isinstance(record, dict):
        check_record(record, tuple(record), "record")
    else:
        check_record(record, (), "record")  # the message for a record that is no dict
    return hashlib.sha256((previous + json.dumps(record, sort_keys=True)).encode("utf-8")).hexdigest()


def _record_lines(records: list[dict], digest: str) -> tuple[str, str]:
    """The records as distill_records.jsonl lines, each with its chained "sha256", and the last digest."""
    lines = []
    for r in records:
        digest = record_digest(digest, r)
        lines.append(json.dumps({**r, SHA256_FIELD: digest}) + "\n")
    return "".join(lines), digest


class RecordLog:
    """Appends the objective's records to distill_records.jsonl, one fsynced line each (a kill loses none that a
    checkpoint after it depends on), each line chained to the one before by `record_digest` from `digest` (the
    last line's digest; distill_run.json's sha256 for an empty log). With `keys` (the run's `record_keys`), each
    record is checked as resume will read it (`check_record`) before it is written: a bad one is a ValueError
    naming it at the call, not a run directory that can never be resumed."""

    def __init__(self, path: Path, digest: str = "", keys: tuple[str, ...] | None = None):
        # a folder (or a path under a file) is a ValueError naming path now, not an IsADirectoryError at a step
        self.path: Path = check_output_file(check_path(path, "path"), "path")  # type: ignore[assignment]
        if keys is not None:
            check_keys(keys)
        self.digest = check_digest("digest", digest)
        self.keys = keys

    def __call__(self, record: dict[str, float]) -> None:
        if self.keys is not None:
            check_record(record, self.keys, "record")
        line, digest = _record_lines([record], self.digest)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.digest = digest


def _next_serial(run_dir: Path) -> int:
    """The serial the next checkpoint saved into run_dir will have at least (one more than the newest complete)."""
    try:
        return find_checkpoint(run_dir).serial + 1
    except ValueError:  # no directory yet, or no complete checkpoint in it
        return 1


def _write(out_dir: str | os.PathLike, settings: dict[str, Any], student_init: str | None, records: list[dict],
           first_serial: int | None = None) -> RecordLog:
    """Write the run's state into out_dir (records first, the run file last) and return its record log.

    Checked before anything is written: out_dir names a folder (not "", which is the working directory, not a
    file or a path under one: `check_output_dir`; no folder where the run's two files go), settings are the run's
    (`check_settings`) and JSON values, and student_init is a str or None (a TypeError / ValueError naming the
    argument, never json's "not JSON serializable" halfway through)."""
    out_dir = check_output_dir(check_path(out_dir, "out_dir"), "out_dir")
    for name in (RECORDS_NAME, RUN_NAME):  # a folder in the way would be an OSError from the atomic write below
        if (out_dir / name).is_dir():
            raise ValueError(f"out_dir {str(out_dir)!r} holds a folder named {name}, where the run's file goes")
    settings = check_settings(settings)
    try:
        json.dumps(settings)
    except (TypeError, ValueError) as e:
        raise TypeError(f"settings must hold JSON values (numbers, strings, None): {e}") from e
    if not (student_init is None or isinstance(student_init, str)):
        raise TypeError(f"student_init must be a str path or None, got {type(student_init).__name__} "
                        f"{short_repr(student_init)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    run = {"format": RUN_FORMAT, "settings": settings, "student_init": student_init,
           "first_serial": _next_serial(out_dir) if first_serial is None else first_serial}
    run[SHA256_FIELD] = content_sha256({}, run)  # of every other field: a hand edit is found on resume
    text, digest = _record_lines(records, run[SHA256_FIELD])  # chained to this run file: an edit is found too
    atomic_write_text(out_dir / RECORDS_NAME, text)
    atomic_write_text(out_dir / RUN_NAME, json.dumps(run, indent=1) + "\n")
    return RecordLog(out_dir / RECORDS_NAME, digest, record_keys(settings["feature_weight"]))


def start_run(out_dir: str | os.PathLike, settings: dict[str, Any], student_init: str | None) -> RecordLog:
    """A fresh run into out_dir: its settings, and an empty record log to append to (the arguments checked as
    `_write` says, before anything is written)."""
    return _write(out_dir, settings, student_init, [])


def resume_run(resume_dir: str | os.PathLike, out_dir: str | os.PathLike | None, settings: dict[str, Any],
               needs_records: bool) -> tuple[list[dict[str, float]], str | None, RecordLog | None]:
    """(records of the checkpoint's steps, the student the run started from, the record log to go on appending
    to (None without out_dir)); ValueError naming what does not match the interrupted run. `settings` as
    `check_settings` says (a TypeError / ValueError naming the field otherwise); the records file is read line by
    line, and a line that is no UTF-8, no JSON or no record, or whose "sha256" is not its `record_digest` (edited,
    dropped or reordered by hand), is a ValueError naming the file and the line."""
    resume_dir = check_path(resume_dir, "resume_dir")
    settings = check_settings(settings)
    needs_records = check_bool("needs_records", needs_records)
    point = find_checkpoint(resume_dir)  # the trainer takes the same one; ValueError if there is none
    run_path = resume_dir / RUN_NAME
    if not run_path.is_file():
        raise ValueError(f"resume={str(resume_dir)!r} holds no {RUN_NAME}: it is not a distillation run directory "
                         "(written by minillm.distill.train.distill with out_dir)")
    run = _check_run(read_json_file(run_path, what="distillation run state"), run_path)
    was = run["settings"]
    differ = [f"{k}={settings[k]!r} (the interrupted run had {was.get(k)!r})" for k in SETTINGS
              if k != "trainer" and settings[k] != was.get(k)]
    was_trainer = was.get("trainer") if isinstance(was.get("trainer"), dict) else {}
    differ += [f"{k}={v!r} (the interrupted run had {was_trainer.get(k)!r})" for k, v in settings["trainer"].items()
               if v != was_trainer.get(k) or type(v) is not type(was_trainer.get(k))]
    if differ:
        raise ValueError(f"resume must continue the interrupted run with its settings; these differ: "
                         f"{'; '.join(differ)}")
    if point.serial < run["first_serial"]:
        raise ValueError(f"the newest checkpoint in {str(resume_dir)!r} ({point.path.name}) is older than the "
                         f"distillation run recorded there (its first checkpoint is serial {run['first_serial']}): "
                         "that run was interrupted before its first save; start it again")
    needed = point.step * settings["grad_accum"] if needs_records else 0
    records: list[dict[str, float]] = []
    if needed:
        keys, digest = record_keys(settings["feature_weight"]), run[SHA256_FIELD]
        if not (resume_dir / RECORDS_NAME).is_file():  # missing, or a folder: named here, not by open()
            raise ValueError(f"{RECORDS_NAME} in {str(resume_dir)!r} is missing or not a file: the run's records "
                             f"of its {point.step} checkpointed steps are needed to resume")
        with open(resume_dir / RECORDS_NAME, "rb") as f:  # bytes: a line that is no UTF-8 is named below
            for number, line in enumerate(f, 1):
                if len(records) == needed:
                    break
                where = f"{RECORDS_NAME} in {str(resume_dir)!r}: line {number}"
                try:
                    record = json.loads(line.decode("utf-8"))
                except ValueError as e:  # no UTF-8, no JSON, or an int past Python's 4300-digit limit
                    raise ValueError(f"{where} is not a record (damaged?): {e}") from e
                except RecursionError as e:  # '[' * 100000: JSON nested past Python's recursion limit
                    raise ValueError(f"{where} is not a record (damaged?): JSON nested too deep") from e
                stored = record.pop(SHA256_FIELD, None) if isinstance(record, dict) else None
                digest = record_digest(digest, check_record(record, keys, where))
                if stored != digest:
                    raise ValueError(f"{where} does not match its field {SHA256_FIELD!r} (edited, dropped, reordered "
                                     "or damaged after the run wrote it): its losses can no longer be trusted; start "
                                     "the run again")
                records.append(record)
        if len(records) < needed:
            raise ValueError(f"{RECORDS_NAME} in {str(resume_dir)!r} holds {len(records)} records, the checkpoint "
                             f"at step {point.step} needs {needed}")
    log = None
    if out_dir is not None:  # the same directory keeps the run's first serial; a new one starts its own count
        same = check_path(out_dir, "out_dir").resolve() == resume_dir.resolve()
        log = _write(out_dir, settings, run["student_init"], records, run["first_serial"] if same else None)
    return records, run["student_init"], log
