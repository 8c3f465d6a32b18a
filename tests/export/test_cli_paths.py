"""`keras-linattn export` keeps to --out, and what it publishes is what the manifest records.

- ``--name`` is one path component (``../x`` and ``a/b`` wrote outside --out or nested folders);
- options are checked before anything is written (``--opset -1`` published a SavedModel version first);
- a failed export takes back the SavedModel version it published;
- a re-export with fewer formats removes the previous export's other formats (a ``--format onnx``
  re-export left the old model's SavedModel, which TF Serving served);
- ``verify`` checks every folder TF Serving would serve, not only the manifest's names.
"""

import json
import os
import shutil

import pytest

from keras_linattn import cli, export
from tests.export.test_export import encoder


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_paths") / "enc.keras"
    encoder("elu", causal=True).save(path)
    return str(path)


@pytest.fixture(scope="module")
def exported(model_file, tmp_path_factory):
    """An export directory with model "a" in both formats (copied by each test that writes to it)."""
    out = tmp_path_factory.mktemp("cli_paths_out") / "out"
    assert cli.main(["export", model_file, "--out", str(out), "--name", "a", "--no-warmup"]) == 0
    return out


def _copy(exported, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(exported, out)
    return out


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def _manifest(out):
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)["models"]


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".", "", "a\\b", ".hidden", "onnx", "keras"])
def test_a_name_that_is_not_one_path_component_is_refused_before_anything_is_written(tmp_path, capsys, name):
    out = tmp_path / "work" / "out"
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "missing.keras", "--out", str(out), "--name", name])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--name must be one plain name" in err and f"Received: --name={name!r}" in err, err
    assert not (tmp_path / "work").exists()  # not --out, not a folder beside it
    with pytest.raises(SystemExit):
        cli.main(["verify", str(out), "--name", name])


def test_the_name_taken_from_the_file_stem_is_checked_too(tmp_path, model_file, capsys):
    path = tmp_path / "onnx.keras"
    shutil.copy(model_file, path)
    with pytest.MonkeyPatch.context() as patch:  # refused before the model is loaded
        patch.setattr(cli, "_load_model", None)
        assert cli.main(["export", str(path), "--out", str(tmp_path / "out"), "--no-warmup"]) == 2
    assert "Received: --name='onnx'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_bad_opset_is_refused_before_anything_is_written(tmp_path, model_file, exported, capsys):
    out = _copy(exported, tmp_path)
    before = _files(out)
    for opset in ("-1", "0", "x"):
        with pytest.raises(SystemExit):
            cli.main(["export", model_file, "--out", str(out), "--name", "b", "--no-warmup", "--opset", opset])
        assert f"--opset must be a positive integer (an ONNX opset). Received: {opset!r}" in capsys.readouterr().err
    assert cli.main(["export", model_file, "--out", str(out), "--name", "b", "--no-warmup", "--opset", "999"]) == 2
    assert "--opset must be an ONNX opset the converter supports" in capsys.readouterr().err
    assert _files(out) == before


def test_a_failed_onnx_conversion_takes_back_the_saved_model_version(tmp_path, model_file, exported, capsys):
    out = _copy(exported, tmp_path)
    before = _files(out)
    # An opset the converter accepts but the model's ops do not exist in: the conversion fails after the
    # SavedModel version was published.
    assert cli.main(["export", model_file, "--out", str(out), "--name", "a", "--no-warmup", "--opset", "3"]) == 2
    assert "Received: opset=3" in capsys.readouterr().err
    assert _files(out) == before  # version 2 is gone; version 1 is what TF Serving and the manifest see
    assert sorted(os.listdir(out / "a")) == ["1"]
    assert cli.main(["verify", str(out), "--shapes", "1x3"]) == 0


def test_a_reexport_with_fewer_formats_removes_the_old_ones(tmp_path, model_file, exported, capsys):
    out = _copy(exported, tmp_path)
    assert os.path.isdir(out / "a" / "1") and os.path.isfile(out / "onnx" / "a.onnx")
    # ONNX only: the old SavedModel (which TF Serving would keep serving) goes.
    assert cli.main(["export", model_file, "--out", str(out), "--name", "a", "--format", "onnx"]) == 0
    assert not (out / "a").exists()
    assert "saved_model" not in _manifest(out)["a"]
    # SavedModel only: the old ONNX graphs go.
    assert (
        cli.main(["export", model_file, "--out", str(out), "--name", "a", "--format", "saved_model", "--no-warmup"])
        == 0
    )
    assert not (out / "onnx" / "a.onnx").exists() and "onnx" not in _manifest(out)["a"]
    capsys.readouterr()
    assert cli.main(["verify", str(out), "--shapes", "1x3"]) == 0
    assert "a: 2/2 checks passed" in capsys.readouterr().out


def test_verify_checks_every_served_folder(tmp_path, exported, capsys):
    out = _copy(exported, tmp_path)
    capsys.readouterr()
    # A folder of versions no manifest entry records (a foreign or failed export).
    shutil.copytree(out / "a", out / "ghost")
    assert cli.main(["verify", str(out), "--shapes", "1x3"]) == 2
    err = capsys.readouterr().err
    assert "ghost/ holds SavedModel versions [1]" in err and "is not a model in manifest.json" in err, err
    shutil.rmtree(out / "ghost")
    # An entry without a SavedModel, beside a folder of versions (the state a --format onnx re-export left).
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["models"]["a"]["saved_model"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["verify", str(out), "--name", "a", "--shapes", "1x3"]) == 2
    assert "'a' has no SavedModel in manifest.json" in capsys.readouterr().err
    # A higher version than the one recorded: TF Serving serves it.
    out = _copy(exported, tmp_path / "again")
    shutil.copytree(out / "a" / "1", out / "a" / "7")
    capsys.readouterr()
    assert cli.main(["verify", str(out), "--shapes", "1x3"]) == 2
    err = capsys.readouterr().err
    assert f"TF Serving serves {os.path.join('a', '7')} (the highest version)" in err, err
    assert export.latest_version_dir(str(out / "a")).endswith("7")


def test_a_name_whose_onnx_files_are_another_models_is_refused(model_file, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"models": {"a": {"keras_model": "keras/a.keras"}}}))
    for name in ("a_step", "a_generate"):
        assert cli.main(["export", model_file, "--out", str(out), "--name", name]) == 2
        err = capsys.readouterr().err
        assert f"--name {name!r} would share an ONNX file with model 'a'" in err, err
    assert sorted(os.listdir(out)) == ["manifest.json"]
