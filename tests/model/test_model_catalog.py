"""The models served by name (model/catalog.py) and the --model flags that name them
(config.split_model_flags): llama-server's --models-dir layout, and every flag mistake refused
with one line naming the flag. Pure file checks: no model is loaded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hydra_trio.cli import build_parser
from hydra_trio.config import settings_from, split_model_flags
from hydra_trio.model.catalog import read_catalog, scan_models_dir


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def test_models_dir_is_read_as_llama_server_reads_it(tmp_path: Path) -> None:
    _touch(tmp_path / "zeta.gguf")
    _touch(tmp_path / "alpha.gguf")
    _touch(tmp_path / "mmproj-alpha.gguf")  # a projector goes with a model, it is not one
    _touch(tmp_path / "mtp-alpha.gguf")  # a draft model likewise
    _touch(tmp_path / "notes.txt")
    _touch(tmp_path / "big" / "big-00002-of-00002.gguf")
    _touch(tmp_path / "big" / "big-00001-of-00002.gguf")  # a split model: its first shard
    _touch(tmp_path / "vision" / "model.gguf")
    _touch(tmp_path / "vision" / "mmproj-model.gguf")
    (tmp_path / "empty").mkdir()
    found = [(e.name, Path(e.path).relative_to(tmp_path).as_posix(), e.source) for e in scan_models_dir(str(tmp_path))]
    assert found == [
        ("alpha", "alpha.gguf", "models_dir"),
        ("big", "big/big-00001-of-00002.gguf", "models_dir"),
        ("vision", "vision/model.gguf", "models_dir"),
        ("zeta", "zeta.gguf", "models_dir"),
    ]


def test_the_catalog_orders_flags_first_pins_the_rpc_model_and_checks_every_name(tmp_path: Path) -> None:
    a, b = _touch(tmp_path / "flags" / "a.gguf"), _touch(tmp_path / "flags" / "b.gguf")
    folder = tmp_path / "dir"
    _touch(folder / "b.gguf")  # named by a flag too: the flag's file wins
    _touch(folder / "c.gguf")
    cat = read_catalog((f"b={b}", f"a={a}"), str(folder), "c", None)
    assert [(e.name, e.path, e.source) for e in cat.entries] == [
        ("b", str(b), "flag"), ("a", str(a), "flag"), ("c", str(folder / "c.gguf"), "models_dir"),
    ]
    assert cat.rpc_model == "b" and cat.pinned == {"b", "c"}
    assert read_catalog((), str(folder), "", None).rpc_model == "b"  # the folder's first by name
    assert read_catalog((), str(folder), "", "c").pinned == {"c"}

    for args, said in (
        (((f"a={a}", f"a={b}"), None, "", None), "--model: a named more than once"),
        (((f"a={tmp_path / 'no.gguf'}",), None, "", None), "no such file"),
        (((f" a={a}",), None, "", None), "without surrounding spaces"),
        (((f"a={a}",), None, "", "z"), "--rpc-model: no model named z (served: a)"),
        (((f"a={a}",), None, "a,y", None), "--model-pin: no model named y"),
        (((), str(tmp_path / "none"), "", None), "not a folder"),
        (((), str(tmp_path / "flags" / "a.gguf"), "", None), "not a folder"),
    ):
        with pytest.raises(SystemExit, match=re.escape(said)):
            read_catalog(*args)  # type: ignore[arg-type]


def test_model_flags_are_one_path_or_names_each(tmp_path: Path) -> None:
    odd = _touch(tmp_path / "x=y.gguf")  # a file whose name has a '=' is still one PATH
    assert split_model_flags([str(odd)]) == (str(odd), ())
    assert split_model_flags(["m.gguf"]) == ("m.gguf", ())
    assert split_model_flags(["a=/m/a.gguf"]) == (None, ("a=/m/a.gguf",))
    assert split_model_flags(["a=/m/a.gguf", "b=/m/b.gguf"]) == (None, ("a=/m/a.gguf", "b=/m/b.gguf"))
    with pytest.raises(SystemExit, match="give one PATH, or NAME=PATH"):
        split_model_flags(["a=/m/a.gguf", "/m/b.gguf"])
    with pytest.raises(SystemExit, match="give one PATH, or NAME=PATH"):
        split_model_flags(["/m/a.gguf", "/m/b.gguf"])

    args = build_parser().parse_args(
        ["serve", "--model", "a=/m/a.gguf", "--model", "b=/m/b.gguf", "--models-max", "2", "--model-pin", "b",
         "--sleep-idle-seconds", "30", "--rpc-model", "b", "--model-wait-s", "9"]
    )
    s = settings_from(args, env={})
    assert (s.model, s.named_models, s.models_max, s.model_pin, s.sleep_idle_seconds, s.rpc_model, s.model_wait_s) == (
        None, ("a=/m/a.gguf", "b=/m/b.gguf"), 2, "b", 30.0, "b", 9.0,
    )
    one = settings_from(build_parser().parse_args(["serve", "--model", "m.gguf"]), env={})
    assert one.model == "m.gguf" and one.named_models == ()
    assert settings_from(None, env={"HYDRA_MODEL": "e.gguf", "HYDRA_MODELS_DIR": "/m"}).models_dir == "/m"
    with pytest.raises(SystemExit, match=r"models_max must be 1\.\.1024"):
        settings_from(None, env={}, models_max=0)
