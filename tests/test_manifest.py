"""The manifest, the commit record of a checkpoint: what it writes, and every way its text is refused."""

from __future__ import annotations

import json

import pytest
from support.checkpoints import DEFAULT_FILES, make_manifest

from resume.checksum import checksum_bytes
from resume.errors import ManifestError
from resume.manifest import SCHEMA, SCHEMA_VERSION, Manifest, check_relative_path

SOURCE = "/runs/r42/step-000000007/manifest.json"


def valid_body(**overrides) -> dict:
    body = json.loads(make_manifest(7).to_json())
    body.update(overrides)
    return body


def parse(body) -> Manifest:
    text = body if isinstance(body, str) else json.dumps(body)
    return Manifest.from_json(text, source=SOURCE)


def test_manifest_round_trips_through_json():
    original = make_manifest(7, expectation={"lr_ahead": [[1e-4]], "next_batch": None},
                             topology={"world_size": 2}, config={"seed": 1234},
                             adapter="native", created_at="2025-01-01T00:00:00+00:00")
    original.train_state.tokens_read = 99
    parsed = Manifest.from_json(original.to_json(), source="m.json")
    assert parsed == original
    assert parsed.total_bytes == sum(len(d) for d in DEFAULT_FILES.values())


def test_manifest_from_bytes_is_accepted():
    original = make_manifest(3)
    assert Manifest.from_json(original.to_json().encode(), source="m.json") == original


def test_manifest_rejects_text_that_is_not_json():
    with pytest.raises(ManifestError, match="expected JSON") as info:
        parse('{"schema": "resume.manifest", ')
    assert SOURCE in str(info.value)


def test_manifest_rejects_non_standard_json_constants():
    with pytest.raises(ManifestError, match="expected JSON"):
        parse(json.dumps(valid_body()).replace('"step": 7', '"step": NaN'))


def test_manifest_rejects_json_that_is_not_an_object():
    with pytest.raises(ManifestError, match="expected a JSON object, actual list") as info:
        parse([1, 2, 3])
    assert SOURCE in str(info.value)


def test_manifest_rejects_wrong_schema():
    with pytest.raises(ManifestError) as info:
        parse(valid_body(schema="someone.else"))
    message = str(info.value)
    assert SOURCE in message and "schema:" in message and "someone.else" in message


def test_manifest_rejects_unknown_schema_version():
    with pytest.raises(ManifestError) as info:
        parse(valid_body(schema_version=99))
    message = str(info.value)
    assert SOURCE in message and "schema_version" in message and "99" in message


@pytest.mark.parametrize("step", [None, -1, "7", True, 1.5], ids=["missing", "negative", "str", "bool", "float"])
def test_manifest_rejects_bad_step(step):
    body = valid_body()
    if step is None:
        del body["step"]
    else:
        body["step"] = step
    with pytest.raises(ManifestError) as info:
        parse(body)
    assert SOURCE in str(info.value) and "step:" in str(info.value)


@pytest.mark.parametrize("files", [None, {}, [], "x"], ids=["missing", "empty", "list", "str"])
def test_manifest_rejects_missing_or_empty_file_list(files):
    body = valid_body()
    if files is None:
        del body["files"]
    else:
        body["files"] = files
    with pytest.raises(ManifestError, match="files: expected a non-empty object") as info:
        parse(body)
    assert SOURCE in str(info.value)


@pytest.mark.parametrize("size", [-1, "17", True, 1.0, None])
def test_manifest_rejects_file_entry_with_bad_size(size):
    body = valid_body(files={"model/shard-0.bin": {"size": size, "checksum": checksum_bytes(b"")}})
    with pytest.raises(ManifestError) as info:
        parse(body)
    message = str(info.value)
    assert SOURCE in message and "files['model/shard-0.bin'].size" in message


@pytest.mark.parametrize("checksum", [None, 12, "sha256:abcd", ""])
def test_manifest_rejects_file_entry_with_bad_checksum(checksum):
    body = valid_body(files={"a.bin": {"size": 1, "checksum": checksum}})
    with pytest.raises(ManifestError) as info:
        parse(body)
    message = str(info.value)
    assert SOURCE in message and "files['a.bin'].checksum" in message


def test_manifest_rejects_file_entry_that_is_not_an_object():
    with pytest.raises(ManifestError, match=r"files\['a.bin'\]: expected an object"):
        parse(valid_body(files={"a.bin": 5}))


@pytest.mark.parametrize("path", ["../x", "/abs", "a/../../b", "C:x", "c:/windows", "a\\..\\b",
                                  "./x", "a//b", "a/", ".", ".."])
def test_manifest_rejects_paths_escaping_the_step_directory(path):
    body = valid_body(files={path: {"size": 1, "checksum": checksum_bytes(b"x")}})
    with pytest.raises(ManifestError) as info:
        parse(body)
    message = str(info.value)
    assert SOURCE in message and "files:" in message and repr(path) in message


@pytest.mark.parametrize("path", ["model.bin", "a/b/c.distcp", "rank-0/.metadata", "x..y"])
def test_relative_paths_inside_the_step_directory_are_accepted(path):
    assert check_relative_path(path, source="m") == path


@pytest.mark.parametrize("name", ["expectation", "topology", "config"])
def test_manifest_rejects_non_object_sections(name):
    with pytest.raises(ManifestError, match=f"{name}: expected an object"):
        parse(valid_body(**{name: [1]}))


def test_manifest_rejects_bad_train_state_naming_the_counter():
    body = valid_body()
    del body["train_state"]["updates_skipped"]
    with pytest.raises(ManifestError, match=r"train_state\.updates_skipped") as info:
        parse(body)
    assert SOURCE in str(info.value)


def test_manifest_schema_constants_are_what_to_json_writes():
    body = json.loads(make_manifest(1).to_json())
    assert body["schema"] == SCHEMA and body["schema_version"] == SCHEMA_VERSION


def test_manifest_text_is_one_line_per_item_and_per_file():
    """Written with the C encoder (``indent`` takes Python's, seconds at 5,120 ranks), still
    readable: a line per top-level item, a line per file, and the same JSON as before."""
    files = {f"__{r}_0.distcp": bytes([r]) * (r + 1) for r in range(5)}
    m = make_manifest(7, files)
    m.expectation = {"rng": ["a", "b"], "next_batch": {"ids": [1, 2], "digest": "x", "samples": 2}}
    text = m.to_json()
    body = json.loads(text)
    assert body == json.loads(json.dumps(body, indent=1))
    lines = text.splitlines()
    for name in files:
        assert sum(1 for line in lines if line.strip().startswith(f'"{name}": {{"size"')) == 1
    assert lines[0] == "{" and lines[-1] == "}"
    assert Manifest.from_json(text, source="m").files == m.files
    assert Manifest.from_json(text, source="m").expectation == m.expectation


def test_pausing_the_collector_nests_and_leaves_it_as_it_found_it():
    import gc

    from resume.collective import collector_paused

    was = gc.isenabled()
    try:
        gc.enable()
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()  # a program that turned it off keeps it off
        with collector_paused():
            pass
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("a failed commit")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
