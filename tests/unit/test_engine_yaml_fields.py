"""``server.config.parse_engine``: the engine section of a YAML config, as YAML 1.1 reads it (bare on / off are
booleans there)."""
import pytest
import yaml

from computron.server.config import ConfigError, parse_engine

pytestmark = pytest.mark.unit


def test_bare_on_and_off_mean_the_strings_and_other_values_still_fail_by_name():
    engine, tp, pp = parse_engine(yaml.safe_load("compile_decode: on\npin_workers: off\nkv_cache: paged\ntp: 2"))
    assert (engine.compile_decode, engine.pin_workers, engine.kv_cache, tp, pp) == ("on", "off", "paged", 2, 1)
    assert parse_engine(yaml.safe_load("compile_decode: off"))[0].compile_decode == "off"
    with pytest.raises(ConfigError, match=r"engine.pin_workers='on': must be 'off' or 'auto'"):
        parse_engine(yaml.safe_load("pin_workers: on"))
    with pytest.raises(ConfigError, match=r"engine.pack_cpu_linears='yes': must be True, False or 'pinned'"):
        parse_engine({"pack_cpu_linears": "yes"})
