"""The report of a study: a trials table (CSV and JSON), a summary, and plots (PNG; HTML too where plotly is).

Written at the end of a search into output_dir/hpo-report, and by `hf-scale report STUDY` from any study file or URL
while a search runs or after it.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from hf_scale.errors import ConfigError
from hf_scale.hpo.storage import JOURNAL_PREFIX, open_storage, quiet_experimental
from hf_scale.safety import mask_secrets

PLOTS = ("optimization_history", "intermediate_values", "param_importances")
SUMMARY_COLUMNS = ("number", "state", "value", "best_evaluation", "evaluations", "duration_s")


def study_storage_spec(study: str) -> str:
    """A storage spec from what a person types: a URL, journal:PATH, a .db file or a journal file."""
    if "://" in study or study.startswith(JOURNAL_PREFIX):
        return study
    path = Path(study)
    if not path.exists():
        raise ConfigError(f"report: no study file {study!r} (give a .db file, a journal file or a storage URL)")
    if path.suffix in (".db", ".sqlite", ".sqlite3"):
        return f"sqlite:///{path.resolve()}"
    return f"{JOURNAL_PREFIX}{path.resolve()}"


def load_study(study: str, study_name: str | None = None) -> optuna.Study:
    """The study in `study` (file or URL); `study_name` may be left out when the storage holds one study."""
    spec = study_storage_spec(study)
    storage = open_storage(spec)
    names = [summary.study_name for summary in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if study_name is None:
        if len(names) != 1:
            raise ConfigError(
                f"report: {mask_secrets(spec)} holds {len(names)} studies ({', '.join(names) or 'none'}); "
                "pick one with --study-name"
            )
        study_name = names[0]
    elif study_name not in names:
        raise ConfigError(
            f"report: no study {study_name!r} in {mask_secrets(spec)}; it has {', '.join(names) or 'none'}"
        )
    return optuna.load_study(study_name=study_name, storage=storage)


def trials_table(study: optuna.Study) -> list[dict[str, Any]]:
    """One row per trial: state, value(s), where its best evaluation was, duration, its values, its error."""
    rows = []
    for trial in study.trials:
        attrs = trial.user_attrs
        duration = trial.duration.total_seconds() if trial.duration else None
        row: dict[str, Any] = {
            "number": trial.number,
            "state": trial.state.name,
            "value": trial.values[0] if trial.values and len(trial.values) == 1 else trial.values,
            "best_evaluation": attrs.get("best_evaluation"),
            "evaluations": len(trial.intermediate_values) or attrs.get("evaluations"),
            "stopped_by": attrs.get("stopped_by"),
            "duration_s": round(duration, 2) if duration is not None else None,
            "retry_of": trial.system_attrs.get("failed_trial"),
            "run_name": attrs.get("run_name"),
            "worker": attrs.get("worker"),
        }
        hyperparameters = attrs.get("hyperparameters", trial.params)
        row.update({f"param_{key}": value for key, value in hyperparameters.items()})
        row["error"] = (attrs.get("error") or "").split("\n", 1)[0] or None
        rows.append(row)
    return rows


def render_summary(study: optuna.Study, rows: list[dict[str, Any]]) -> str:
    """Counts by state, the best trial, and the table's main columns as text."""
    states = [row["state"] for row in rows]
    lines = [
        f"study {study.study_name!r}: {len(rows)} trial(s): "
        + ", ".join(f"{state.lower()} {states.count(state)}" for state in sorted(set(states)))
    ]
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    if complete and len(study.directions) == 1:
        best = study.best_trial
        lines.append(f"best: trial {best.number}, value {best.value:.6g}, {best.user_attrs.get('hyperparameters')}")
    params = sorted({key for row in rows for key in row if key.startswith("param_")})
    columns = [*SUMMARY_COLUMNS, *params]
    lines.append("  ".join(f"{column.removeprefix('param_'):>14}" for column in columns))
    for row in rows:
        lines.append("  ".join(f"{_cell(row.get(column)):>14}" for column in columns))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)[:14]


def write_table(rows: list[dict[str, Any]], folder: Path) -> tuple[Path, Path]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    csv_path, json_path = folder / "trials.csv", folder / "trials.json"
    with csv_path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return csv_path, json_path


def draw_plots(study: optuna.Study, folder: Path) -> list[Path]:
    """The three plots as PNG (and HTML when plotly is installed); a plot the study cannot make yet is skipped."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_matplotlib

    has_plotly = importlib.util.find_spec("plotly") is not None
    written = []
    target = None if len(study.directions) == 1 else (lambda t: t.values[0])
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    for name in PLOTS:
        if name == "param_importances" and (len(complete) < 2 or len(study.directions) > 1):
            continue  # importances need two complete trials and one objective
        if name == "intermediate_values" and not any(t.intermediate_values for t in study.trials):
            continue
        kwargs: dict[str, Any] = (
            {"target": target, "target_name": "objective"} if name != "intermediate_values" and target else {}
        )
        if name == "param_importances" and importlib.util.find_spec("sklearn") is None:
            # Optuna's default (fANOVA) needs scikit-learn; PED-ANOVA needs nothing more.
            with quiet_experimental():
                kwargs["evaluator"] = optuna.importance.PedAnovaImportanceEvaluator()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            try:
                axes = getattr(optuna_matplotlib, f"plot_{name}")(study, **kwargs)
            except (ValueError, RuntimeError, ImportError) as error:  # e.g. every value of a parameter the same
                print(f"hf_scale hpo: no {name} plot: {error}")
                continue
            if name == "intermediate_values":  # trials report at each evaluation, numbered from 1
                axes.set_xlabel("evaluation")
                axes.set_ylabel("objective")
            figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            path = folder / f"{name}.png"
            figure.savefig(path, dpi=100)
            plt.close(figure)
            written.append(path)
            if has_plotly:
                from optuna import visualization

                html = folder / f"{name}.html"
                getattr(visualization, f"plot_{name}")(study, **kwargs).write_html(str(html))
                written.append(html)
    return written


def write_report(study: optuna.Study, folder: str | Path) -> Path:
    """Trials table, summary and plots of `study` in `folder`; return the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = trials_table(study)
    write_table(rows, folder)
    (folder / "summary.txt").write_text(render_summary(study, rows) + "\n")
    draw_plots(study, folder)
    return folder
