"""Published results are rendered from the files their commands wrote (:mod:`kvsieve.results`): every page agrees
with its data, a result of each kind renders with where it comes from, and a page that disagrees is caught."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from kvsieve.benchmarks import stream_engine
from kvsieve.cli import main
from kvsieve.provenance import provenance
from kvsieve.results import main as results_main
from kvsieve.results import render, render_file, stale_pages

ROOT = Path(__file__).resolve().parents[2]


def test_every_page_agrees_with_its_data() -> None:
    assert "<!-- results: " in (ROOT / "README.md").read_text()
    assert stale_pages(ROOT) == [], "run: python -m kvsieve.results"


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def compare_result(tiny_dir) -> dict:
    """``kvsieve compare --json`` of the tiny model, as a result file holds it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # (capsys is per test)
        argv = ["compare", "--model", tiny_dir, "--max-tokens", "48", "--budget", "16", "--sample-tokens", "3"]
        assert main([*argv, "--policies", "full", "h2o", "local", "--json"]) == 0
    return json.loads(out.getvalue())


def test_a_compare_result_renders_each_policy_and_where_it_comes_from(compare_result, tmp_path) -> None:
    (tmp_path / "r.json").write_text(json.dumps(compare_result))
    text = render_file(tmp_path / "r.json")
    rows = {r["policy"]: r for r in compare_result["rows"]}
    for name, row in rows.items():
        assert f"| `{name}` | " in text and f"{row['ppl']:.3f}" in text
    assert "| `full` | all | " in text and "1.000×" in text
    origin = compare_result["provenance"]
    assert origin["date"] in text and origin["versions"]["torch"] in text
    # the command as given, but the model's absolute path (where the run's files were) by its name alone
    model = origin["command"][origin["command"].index("--model") + 1]
    assert Path(model).is_absolute() and model not in text
    assert " ".join(Path(a).name if a == model else a for a in origin["command"]) in text
    assert origin["cpu"]["name"] in text and f"{origin['threads']} torch thread(s)" in text


def test_a_page_that_disagrees_with_its_data_is_caught_and_rendered(compare_result, tmp_path) -> None:
    (tmp_path / "r.json").write_text(json.dumps(compare_result))
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n<!-- results: r.json -->\n<!-- /results -->\n\nAfter.\n")
    check = ["--check", "--root", str(tmp_path), str(page)]
    assert results_main(check) == 1  # (an empty block is stale)
    assert results_main(["--root", str(tmp_path), str(page)]) == 0
    assert results_main(check) == 0 and page.read_text().endswith("<!-- /results -->\n\nAfter.\n")
    changed = json.loads(json.dumps(compare_result))
    changed["rows"][0]["ppl"] *= 1.01
    (tmp_path / "r.json").write_text(json.dumps(changed))
    assert results_main(check) == 1 and stale_pages(tmp_path, [page]) == [page]


def test_bench_results_render_their_cells_and_checks(tiny_dir, capsys, tmp_path) -> None:
    argv = ["bench", "--model", tiny_dir, "--prompt-lens", "40", "--gen-lens", "4", "--batches", "1"]
    result = _json(capsys, *argv, "--policies", "h2o", "--budget", "16", "--repeats", "1")
    (tmp_path / "b.json").write_text(json.dumps(result))
    text = render_file(tmp_path / "b.json")
    for cell in result["cells"]:
        assert f"| `{cell['policy']}` | 40+4 | 1 | " in text
    assert "kvsieve bench" in text


def test_a_stream_engine_result_renders_each_policy(llama_gqa, make_ids, tmp_path) -> None:
    result = stream_engine.stream_engine(llama_gqa, make_ids(1, stream_engine.LENGTH)[0], ["h2o"], progress=False)
    result["provenance"] = provenance(["kvsieve", "bench", "--preset", "stream-engine"], model="tiny")
    (tmp_path / "s.json").write_text(json.dumps(result))
    text = render_file(tmp_path / "s.json")
    (row,) = result["stream_engine"]
    assert f"| `h2o` | {row['whole_tok_s']:.1f} | " in text and result["checks"][0]["check"] in text


def test_a_result_of_another_command_is_refused(tmp_path) -> None:
    (tmp_path / "p.json").write_text(json.dumps({"provenance": {"command": ["kvsieve", "policies", "--json"]}}))
    with pytest.raises(ValueError, match="no renderer for the result of `kvsieve policies`"):
        render("<!-- results: p.json -->\n<!-- /results -->", tmp_path)


@pytest.mark.parametrize("view", ["overview", "claims", "leaders"])
def test_a_ruler_view_of_a_result_file_is_refused(compare_result, tmp_path, view: str) -> None:
    (tmp_path / "r.json").write_text(json.dumps(compare_result))
    with pytest.raises(ValueError, match=f"`{view}` is a view of a kvsieve ruler directory"):
        render(f"<!-- results: r.json {view} -->\n<!-- /results -->", tmp_path)


def test_a_figure_in_prose_is_read_from_its_data_and_a_typed_one_that_disagrees_fails_the_check(
    compare_result, tmp_path
):
    (tmp_path / "r.json").write_text(json.dumps(compare_result))
    h2o = next(r for r in compare_result["rows"] if r["policy"] == "h2o")
    tag = "<!-- figure: r.json rows[policy=h2o].ppl:.2f -->"
    page = tmp_path / "page.md"
    page.write_text(f"h2o's perplexity is {tag}1.00<!-- /figure --> here.\n")  # (typed by hand, and wrong)
    assert stale_pages(tmp_path, [page]) == [page]
    assert results_main(["--check", "--root", str(tmp_path), str(page)]) == 1
    assert results_main(["--root", str(tmp_path), str(page)]) == 0
    assert page.read_text() == f"h2o's perplexity is {tag}{h2o['ppl']:.2f}<!-- /figure --> here.\n"
    assert stale_pages(tmp_path, [page]) == []


def test_figure_selects_by_key_or_index_and_names_a_field_that_leads_nowhere() -> None:
    from kvsieve.results import figure

    result = {"rows": [{"policy": "full", "ppl": 1.5}, {"policy": "h2o", "ppl": 2.5}], "n": 3}
    assert figure(result, "rows[policy=h2o].ppl") == 2.5
    assert figure(result, "rows[0].policy") == "full" and figure(result, "rows[-1].ppl") == 2.5
    assert figure(result, "n") == 3
    for field in ("rows[policy=tova].ppl", "rows[2].ppl", "rows[policy=h2o].kv", "missing"):
        with pytest.raises(ValueError, match=r"no single value at"):
            figure(result, field)


def test_figure_selects_by_several_keys_reduces_a_selection_and_divides_two_figures() -> None:
    from kvsieve.results import figure

    rows = [
        {"task": "a", "policy": "full", "compression": 0.0, "score": 90.0, "s": 4.0},
        {"task": "b", "policy": "full", "compression": 0.0, "score": 70.0, "s": 2.0},
        {"task": "a", "policy": "h2o", "compression": 0.75, "score": 30.0, "s": 1.0},
        {"task": "b", "policy": "h2o", "compression": 0.75, "score": 20.0, "s": 3.0},
    ]
    result = {"rows": rows}
    assert figure(result, "rows[task=b,policy=h2o,compression=0.75].score") == 20.0  # (a value with a dot)
    assert figure(result, "rows{policy=full}.score.mean") == 80.0
    assert figure(rows, "{compression=0.75}.score.max") == 30.0 and figure(rows, "{task=a}.s.sum") == 5.0
    assert figure(rows, "{policy=h2o}.count") == 2 and figure(rows, "[task=a,policy=h2o].score") == 30.0
    assert figure(result, "rows[0].s/rows[1].s") == 2.0 and figure(result, "rows[0].s*rows[3].s/rows[1].s") == 6.0
    assert figure(result, "rows{policy=full}.score.mean/rows{policy=h2o}.score.mean") == 3.2
    assert figure(result, "rows[1].s*1000/rows[3].s*1.5") == 1000.0
    nowhere = ("rows{policy=tova}.score.mean", "rows[policy=full].score", "rows[0].s/rows[4].s", "rows[0]/n", "rows[x")
    for field in nowhere:
        with pytest.raises(ValueError, match=r"no single value at"):
            figure(result, field)


def test_a_figure_selects_a_value_that_holds_a_colon_and_formats_what_follows_the_last(tmp_path) -> None:
    rows = [{"policy": "snapkv", "score": 45.64}, {"policy": "snapkv:pooling=mean", "score": 52.61}]
    (tmp_path / "r.json").write_text(json.dumps(rows))
    tag = "<!-- figure: r.json [policy=snapkv:pooling=mean].score:.1f -->"
    assert render(f"{tag}0<!-- /figure -->", tmp_path) == f"{tag}52.6<!-- /figure -->"
