"""`environ.env_get`: os.environ.get's answers, for names set, changed and removed at run time."""
from __future__ import annotations

import os

from flashdispatch import checks
from flashdispatch.environ import env_get

NAME = "FLASHDISPATCH_TEST_ENV_GET"


def test_env_get_follows_os_environ(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_get(NAME) is None
    monkeypatch.setenv(NAME, "a value é")
    assert env_get(NAME) == os.environ.get(NAME) == "a value é"
    os.environ[NAME] = ""
    assert env_get(NAME) == ""
    del os.environ[NAME]
    assert env_get(NAME) is None


def test_env_get_reads_a_replaced_environ(monkeypatch):
    """A mapping put in os.environ's place (as some test harnesses do) is read as it is."""
    monkeypatch.setattr(os, "environ", {NAME: "replaced"})
    assert env_get(NAME) == "replaced"
    assert env_get(NAME + "_UNSET") is None


def test_the_check_switch_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "0")
    assert not checks.page_indices_checked() and not checks.device_values_checked()
    monkeypatch.setenv(checks.CHECK_INPUTS_ENV, "1")
    assert checks.page_indices_checked() and checks.device_values_checked()
    monkeypatch.delenv(checks.CHECK_INPUTS_ENV)
    assert checks.page_indices_checked() and not checks.device_values_checked()
