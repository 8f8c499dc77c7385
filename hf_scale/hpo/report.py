"""The report of a study: a trials table (CSV and JSON), a summary, and plots (PNG; HTML too where plotly is).

Written at the end of a search into output_dir/hpo-report, and by `hf-scale report STUDY` from any study file or URL
while a search runs or after it.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import optuna
import pandas
from optuna.trial import TrialState

from hf_scale.errors import ConfigError
from hf_scale.hpo.storage import JOURNAL_PREFIX, open_storage
from hf_scale.safety import mask_secrets

PLOTS = ("optimization_history", "intermediate_values", "param_importances")
SUMMARY_COLUMNS = ["number", "state", "value", "best_evaluation", "evaluations", "duration_s"]
COLUMNS = [*SUMMARY_COLUMNS, "stopped_by", "retry_of", "run_name", "worker"]


def load_study(study: str, study_name: str | None = None) -> optuna.Study:
    """The study in `study` (a URL, journal:PATH, a .db file or a journal file); `study_name` may be left out when
    the storage holds one study."""
    spec = study
    if "://" not in study and not study.startswith(JOURNAL_PREFIX):
        path = Path(study)
        if not path.exists():
            raise ConfigError(f"report: no study file {study!r} (give a .db file, a journal file or a storage URL)")
        sqlite = path.suffix in (".db", ".sqlite", ".sqlite3")
        spec = f"{'sqlite:///' if sqlite else JOURNAL_PREFIX}{path.resolve()}"
    storage = open_storage(spec)
    names = optuna.get_all_study_names(storage)
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


def trials_table(study: optuna.Study) -> pandas.DataFrame:
    """One row per trial: Optuna's `trials_dataframe()`, with hf_scale's trial attributes as plain columns, the values
    each trial applied as `param_*` (derived ones such as gradient_accumulation_steps included), and its error's first
    line."""
    table = study.trials_dataframe(
        attrs=("number", "state", "value", "duration", "params", "user_attrs", "system_attrs", "intermediate_values")
    )
    if table.empty:
        return pandas.DataFrame(columns=COLUMNS)
    table.columns = [column.removeprefix("user_attrs_") for column in table.columns]
    evaluated = table.filter(like="intermediate_values_").notna().sum(axis=1)
    if "evaluations" in table:
        evaluated = evaluated.where(evaluated > 0, table["evaluations"])
    table["evaluations"] = evaluated
    table["duration_s"] = pandas.to_timedelta(table["duration"]).dt.total_seconds().round(2)  # NaT while running
    table = table.rename(columns={"system_attrs_failed_trial": "retry_of"}).reindex(
        columns=[*COLUMNS, "hyperparameters", "error", *table.filter(like="params_").columns]
    )
    if table["hyperparameters"].notna().all():  # what the trials applied, not only what Optuna sampled
        applied = pandas.DataFrame(table["hyperparameters"].tolist(), index=table.index)
        table = pandas.concat(
            [table.drop(columns=table.filter(like="params_").columns), applied.add_prefix("params_")], axis=1
        )
    table.columns = [column.replace("params_", "param_", 1) for column in table.columns]
    table["error"] = table["error"].map(lambda error: error.split("\n")[0] if isinstance(error, str) else None)
    return table.drop(columns="hyperparameters")


def render_summary(study: optuna.Study, table: pandas.DataFrame) -> str:
    """Counts by state, the best trial, and the table's main columns as text."""
    counts = table["state"].value_counts().sort_index()
    lines = [
        f"study {study.study_name!r}: {len(table)} trial(s): "
        + ", ".join(f"{s.lower()} {n}" for s, n in counts.items())
    ]
    if (table["state"] == "COMPLETE").any():
        best = study.best_trial
        lines.append(f"best: trial {best.number}, value {best.value:.6g}, {best.user_attrs.get('hyperparameters')}")
    columns = [*SUMMARY_COLUMNS, *table.filter(like="param_").columns]
    lines.append(table[columns].to_string(index=False, na_rep="-", float_format="{:.4g}".format))
    return "\n".join(lines)


def draw_plots(study: optuna.Study, folder: Path) -> None:
    """The three plots as PNG (and HTML when plotly is installed); a plot the study cannot make yet is skipped."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_matplotlib

    has_plotly = importlib.util.find_spec("plotly") is not None
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    for name in PLOTS:
        if name == "param_importances" and len(complete) < 2:
            continue  # importances need two complete trials
        if name == "intermediate_values" and not any(t.intermediate_values for t in study.trials):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots (and PED-ANOVA) experimental
            kwargs: dict[str, Any] = {}
            if name == "param_importances" and importlib.util.find_spec("sklearn") is None:
                # Optuna's default (fANOVA) needs scikit-learn; PED-ANOVA needs nothing more.
                kwargs["evaluator"] = optuna.importance.PedAnovaImportanceEvaluator()
            try:
                axes = getattr(optuna_matplotlib, f"plot_{name}")(study, **kwargs)
            except (ValueError, RuntimeError, ImportError) as error:  # e.g. every value of a parameter the same
                print(f"hf_scale hpo: no {name} plot: {error}")
                continue
            if name == "intermediate_values":  # trials report at each evaluation, numbered from 1
                axes.set_xlabel("evaluation")
                axes.set_ylabel("objective")
            figure = axes.figure
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            figure.savefig(folder / f"{name}.png", dpi=100)
            plt.close(figure)
            if has_plotly:
                from optuna import visualization

                getattr(visualization, f"plot_{name}")(study, **kwargs).write_html(str(folder / f"{name}.html"))


def write_report(study: optuna.Study, folder: str | Path) -> Path:
    """Trials table, summary and plots of `study` in `folder`; return the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    table = trials_table(study)
    table.to_csv(folder / "trials.csv", index=False)
    (folder / "trials.json").write_text(table.to_json(orient="records", indent=2) + "\n")
    (folder / "summary.txt").write_text(render_summary(study, table) + "\n")
    draw_plots(study, folder)
    return folder
