"""flashtile.config: environment parsing, validation and the override context manager."""

import pytest

from flashtile import config


def test_defaults_when_nothing_is_set():
    s = config.from_environment({})
    assert s == config.Settings()
    assert s.gluon and s.fast_launch and not s.interpret and s.decode_route is None


def test_environment_values_are_parsed():
    s = config.from_environment({"FLASHTILE_INTERPRET": "1", "FLASHTILE_GLUON": "0",
                                 "FLASHTILE_FWD_CONFIGS": "/tmp/t.json", "FLASHTILE_DECODE_ROUTE": "split"})
    assert s.interpret and not s.gluon and s.fwd_configs == "/tmp/t.json" and s.decode_route == "split"


def test_bad_switch_value_names_the_variable():
    with pytest.raises(ValueError, match="FLASHTILE_GLUON"):
        config.from_environment({"FLASHTILE_GLUON": "maybe"})


def test_unknown_variable_warns_with_its_name():
    with pytest.warns(RuntimeWarning, match="FLASHTILE_DECODE_ROWS"):
        config.from_environment({"FLASHTILE_DECODE_ROWS": "4"})


def test_at_most_eight_public_variables():
    assert len(config.ENV_FIELDS) <= 8


def test_override_restores_and_rejects_unknown_names():
    before = config.get()
    with config.override(gluon=False, fwd_tiles=(16, 16, 4, 1)) as s:
        assert config.get() is s and not s.gluon and s.fwd_tiles == (16, 16, 4, 1)
    assert config.get() is before
    with pytest.raises(TypeError):
        with config.override(no_such_setting=1):
            pass
    assert config.get() is before
