"""runtime.topics: every builder parses back to what built it; anything else is refused."""
from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest
from hypothesis import given

from runtime import topics
from runtime.errors import RemoteViolation
from runtime.topics import ParsedTopic, Topics, parse

from runtime_strategies import bounded, ids


@bounded(100)
@given(site=ids, dev=ids)
def test_builders_parse_back(site: str, dev: str) -> None:
    t = Topics(site)
    for leaf in sorted(topics.DEVICE_LEAVES):
        assert parse(t.device(dev, leaf)) == ParsedTopic(site, "dev", dev, leaf)
    assert parse(t.fog_state()) == ParsedTopic(site, "fog", "", "STATE")
    assert parse(t.rebirth()) == ParsedTopic(site, "fog", "", "REBIRTH")
    assert parse(t.infer()) == ParsedTopic(site, "fog", "", "INFER")
    assert parse(t.control()) == ParsedTopic(site, "fog", "", "CTL")
    assert parse(t.summary()) == ParsedTopic(site, "fog", "", "SUMMARY")
    assert parse(t.release()) == ParsedTopic(site, "cloud", "", "RELEASE")
    assert parse(t.reply(dev)) == ParsedTopic(site, "reply", dev, "")


@bounded(60)
@given(site=ids, dev=ids)
def test_filters_match_what_they_should(site: str, dev: str) -> None:
    t = Topics(site)
    assert mqtt.topic_matches_sub(t.device_prefix(dev), t.device(dev, "CMD"))
    assert mqtt.topic_matches_sub(t.all_devices("STATE"), t.device(dev, "STATE"))
    assert not mqtt.topic_matches_sub(t.all_devices("STATE"), t.device(dev, "BIRTH"))
    assert not mqtt.topic_matches_sub(t.device_prefix(dev), t.device(dev + "x", "CMD"))


@pytest.mark.parametrize("topic", [
    "",
    "fogline",
    "fogline/v1",
    "fogline/v1/site",
    "fogline/v1/site/dev",
    "fogline/v2/site/fog/STATE",
    "other/v1/site/fog/STATE",
    "/fogline/v1/site/fog/STATE",
    "fogline/v1/site/dev/d1",
    "fogline/v1/site/dev/d1/NOPE",
    "fogline/v1/site/dev/d1/BIRTH/extra",
    "fogline/v1/site/dev/d1/birth",
    "fogline/v1/site/fog/STATE/extra",
    "fogline/v1/site/cloud",
    "fogline/v1/site/reply/c1/x",
    "fogline/v1/site/unknown/x",
    "fogline/v1//fog/STATE",
    "fogline/v1/site/dev//BIRTH",
    "fogline/v1/site/reply/",
    "fogline/v1/site/fog/",
    "fogline/v1/+/fog/STATE",
    "fogline/v1/site/dev/+/STATE",
    "fogline/v1/site/dev/#",
    "fogline/v1/#/reply/c1",
    "fogline/v1/site/reply/a\x00b",
])
def test_malformed_topics_are_refused(topic: str) -> None:
    with pytest.raises(RemoteViolation):
        parse(topic)
