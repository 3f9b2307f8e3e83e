"""Models known by name (`loader.catalog`, `sluice models`): a file split over installed packages is
joined into the cache once and checked against its sha256; a model not pulled, or whose parts do
not join into the expected file, is refused with what to run; `--model NAME` loads it.

The split model here is made of small packages written for the test (what is tested is the
joining, not a model); the default model's entry is the real one."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest

from sluice.engine.errors import ModelError
from sluice.engine.loader import catalog, load_tokenizer, model_path
from sluice.engine.loader.default import default_model_path

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A 3-part model whose parts are packages in a folder on sys.path, and its joined bytes."""
    data = bytes(range(256)) * 1000
    pieces = [data[:100_000], data[100_000:200_001], data[200_001:]]
    site = tmp_path / "site"
    parts = []
    for i, piece in enumerate(pieces, start=1):
        package = site / f"catalog_test_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"p{i}.bin").write_bytes(piece)
        parts.append(catalog.Part(f"catalog-test-part{i}==1.0", package.name, f"data/p{i}.bin"))
    monkeypatch.syspath_prepend(str(site))
    model = catalog.KnownModel(
        name="test-model",
        description="three parts",
        file_name="test-model.gguf",
        parts=tuple(parts),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        architecture="llama",
        served=True,
    )
    monkeypatch.setitem(catalog.MODELS, model.name, model)
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    return model, data, site


def test_the_parts_are_joined_once_into_the_cache_and_checked(split_model):
    model, data, _ = split_model
    seen = []
    path = catalog.locate(model.name, progress=lambda done, total: seen.append((done, total)))
    assert path.read_bytes() == data and path.parent == catalog.cache_dir()
    assert seen[-1] == (len(data), len(data))
    # found in the cache the next time: nothing is read again
    seen.clear()
    assert catalog.locate(model.name, progress=lambda *a: seen.append(a)) == path and not seen
    assert model_path(model.name) == path  # what --model NAME loads


def test_a_model_not_pulled_is_refused_with_the_command_to_pull_it(split_model):
    model, _, site = split_model
    (site / "catalog_test_part2" / "data" / "p2.bin").unlink()
    with pytest.raises(ModelError) as e:
        catalog.locate(model.name)
    assert e.value.field == "model" and f"sluice models pull {model.name}" in str(e.value)
    assert [p.package for p in catalog.missing(model)] == ["catalog_test_part2"]


def test_parts_that_do_not_join_into_the_expected_file_are_refused(split_model):
    model, _, site = split_model
    (site / "catalog_test_part3" / "data" / "p3.bin").write_bytes(b"not the same bytes")
    with pytest.raises(ModelError) as e:
        catalog.locate(model.name)
    assert "--force" in str(e.value)
    assert not list(catalog.cache_dir().iterdir())  # no half-made or wrong file is left behind


def test_a_changed_file_in_the_cache_is_joined_again(split_model):
    model, data, _ = split_model
    path = catalog.locate(model.name)
    path.write_bytes(data[:-1])
    assert catalog.locate(model.name).read_bytes() == data


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelError) as e:
        catalog.locate("no-such-model")
    assert all(name in str(e.value) for name in catalog.MODELS)


def test_the_default_models_name_is_the_default_models_file():
    assert model_path("smollm2-135m") == default_model_path()
    tokenizer, config = load_tokenizer("smollm2-135m")
    assert config.architecture == "llama" and tokenizer.encode("Hello")


def test_a_path_is_a_path_even_where_it_is_also_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()
    assert model_path("smollm2-135m") == Path("smollm2-135m")


def test_the_models_extra_installs_every_known_models_packages():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    want = {d for m in catalog.MODELS.values() for d in m.distributions}
    assert set(extras["models"]) == want


def test_pulled_models_join_into_their_published_files():
    """Where a split model's packages are installed (`sluice models pull`), its joined file is
    the one its entry names."""
    pulled = [m for m in catalog.MODELS.values() if len(m.parts) > 1 and not catalog.missing(m)]
    if not pulled:
        pytest.skip("no split model is pulled here (sluice models pull gemma3-270m)")
    for model in pulled:
        path = catalog.locate(model.name)
        assert path.stat().st_size == model.size


def test_sluice_models_lists_pulls_and_locates(split_model, capsys, monkeypatch):
    from sluice.cli import main

    model, data, _ = split_model
    assert main(["models", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in catalog.MODELS)
    # its packages are there already: pull joins them without pip
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("pip ran"))
    assert main(["models", "pull", model.name]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.read_bytes() == data
    assert main(["models", "path", model.name]) == 0
    assert Path(capsys.readouterr().out.strip()) == path
    assert main(["models", "path", "no-such-model"]) == 1
    assert "unknown model" in capsys.readouterr().err
