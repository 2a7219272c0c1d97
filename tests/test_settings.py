"""The settings, declared once (kvlocal/settings.py): the command line's flags are the fields', a request's
overrides are ``dataclasses.replace``, and a bad value is one error naming its field, worded where it lands."""

from __future__ import annotations

import dataclasses

import pytest

from kvlocal.cli import build_parser
from kvlocal.errors import CacheFull, SettingError, UsageError, worded
from kvlocal.settings import (ChatSettings, RuntimeSettings, chat_settings_from_args, flag_name,
                              runtime_settings_from_args)


@pytest.mark.parametrize("command", ["chat", "run", "serve"])
def test_the_flags_defaults_are_the_settings_defaults(command):
    """Every command that takes the settings' flags, given none, makes the default settings (-n is each command's:
    ``max_reply`` is left out)."""
    extra = ("--prompt-file", "x") if command == "run" else ()
    args = build_parser().parse_args([command, *extra])
    assert chat_settings_from_args(args, max_reply=ChatSettings.max_reply) == ChatSettings()
    assert runtime_settings_from_args(args) == RuntimeSettings()


def test_every_flag_sets_its_field():
    """A flag given on the command line reaches its field, converted as the field declares (on/off → a bool)."""
    args = build_parser().parse_args(["chat", "--budget", "256", "--recall", "off", "--pin-system", "off", "-c", "4096",
                                      "-ngl", "-1", "-t", "3", "--rpc", "10.0.0.2:50052,10.0.0.3:50052",
                                      "--tensor-split", "3,1", "--window", "16", "--read-cells", "whole"])
    s, r = chat_settings_from_args(args), runtime_settings_from_args(args)
    assert (s.budget, s.recall, s.pin_system, s.ctx_size, s.recent) == ("256", False, False, 4096, 16)
    assert s.read_cells is None and s.engine_keywords()["read_cells"] is None  # whole: no cap
    assert chat_settings_from_args(build_parser().parse_args(["chat", "--read-cells", "8192"])).read_cells == 8192
    assert (r.n_gpu_layers, r.n_threads, r.rpc, r.tensor_split) == (-1, 3, ("10.0.0.2:50052", "10.0.0.3:50052"),
                                                                    (3.0, 1.0))
    assert r.model_keywords() == {"n_gpu_layers": -1, "rpc": r.rpc, "tensor_split": r.tensor_split}
    assert "rpc" not in RuntimeSettings().model_keywords()  # only where set: a runtime without them loads as before


def test_settings_that_mean_the_same_are_equal_and_a_request_replaces_fields():
    """The canonical forms make equal settings ``==`` (a restored session is compared so); what a request overrides
    is ``dataclasses.replace``, checked like any other settings."""
    assert ChatSettings(budget=0.10, cache_type_k="F16", recall_mem="1G") == ChatSettings(budget="0.1",
                                                                                        recall_mem=1 << 30)
    served = ChatSettings(budget="256")
    assert dataclasses.replace(served, budget=64).budget == "64"
    with pytest.raises(SettingError) as e:
        dataclasses.replace(served, budget="lots")
    assert e.value.field == "budget"


@pytest.mark.parametrize("make, field, flag", [
    (lambda: ChatSettings(budget="x"), "budget", "--budget"),
    (lambda: ChatSettings(ctx_size=-1), "ctx_size", "-c/--ctx-size"),
    (lambda: ChatSettings(recall=False, recall_dir="/tmp"), "recall_dir", "--recall-dir"),
    (lambda: ChatSettings(method="meanmerge", recall=True), "recall", "--recall"),
    (lambda: ChatSettings(read_cells=-1), "read_cells", "--read-cells"),
    (lambda: RuntimeSettings(n_threads=0), "n_threads", "-t/--threads"),
    (lambda: RuntimeSettings(rpc="no-port"), "rpc", "--rpc"),
])
def test_a_bad_setting_names_its_field_and_each_door_words_it(make, field, flag):
    """The text raised names the field (``kvlocal.Chat``'s keyword); the command line words it as the flag, the
    server as the request's JSON path; neither reads the other's name."""
    from kvlocal.server.requests import json_name

    with pytest.raises(SettingError) as e:
        make()
    assert e.value.field == field and isinstance(e.value, UsageError)
    assert str(e.value).startswith(field) and "--" not in str(e.value)
    assert worded(e.value, flag_name).startswith(flag)
    server = worded(e.value, json_name)
    assert server.startswith("kv." + field if field in ("budget", "recall") else flag)


def test_errors_have_kinds_with_statuses():
    """A full cache is not a bad setting: its own kind, the setting it names filled in the same way."""
    e = CacheFull("5000 tokens exceed the cap of 4096 this session was sized for: raise {ctx_size}", "ctx_size")
    assert str(e).endswith("raise ctx_size") and worded(e, flag_name).endswith("raise -c/--ctx-size")
    assert e.status == 400 and e.code == "context_length_exceeded"
    assert worded(ValueError("plain"), flag_name) == "plain"
