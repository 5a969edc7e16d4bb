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
    for leaf in sorted(topics.OWN_LEAVES):
        assert parse(t.device(dev, leaf)) == ParsedTopic(site, "dev", dev, leaf, dev)
    assert parse(t.device(dev, "CMD")) == ParsedTopic(site, "dev", dev, "CMD")
    assert parse(t.activation(dev, site)) == ParsedTopic(site, "dev", dev, "ACT", site)
    assert parse(t.fog_state()) == ParsedTopic(site, "fog", "", "STATE")
    assert parse(t.rebirth()) == ParsedTopic(site, "fog", "", "REBIRTH")
    assert parse(t.infer(dev)) == ParsedTopic(site, "fog", "", "INFER", dev)
    assert parse(t.control(dev)) == ParsedTopic(site, "fog", "", "CTL", dev)
    assert parse(t.summary()) == ParsedTopic(site, "fog", "", "SUMMARY")
    assert parse(t.release(dev)) == ParsedTopic(site, "cloud", "", "RELEASE", dev)
    assert parse(t.reply(dev)) == ParsedTopic(site, "reply", dev, "")
    assert parse(t.result(site, dev)) == ParsedTopic(site, "reply", site, "", dev)


def test_an_activation_topic_names_its_sender() -> None:
    from runtime.errors import LocalViolation
    with pytest.raises(LocalViolation):
        Topics("s").device("d", "ACT")
    assert mqtt.topic_matches_sub(Topics("s").activation("d", "+"), Topics("s").activation("d", "e"))
    assert not mqtt.topic_matches_sub(Topics("s").activation("d", "+"), Topics("s").activation("x", "e"))


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
    "fogline/v1/site/reply/c1/x/y",
    "fogline/v1/site/dev/d1/ACT",
    "fogline/v1/site/dev/d1/ACT/a/b",
    "fogline/v1/site/dev/d1/STATE/d1",
    "fogline/v1/site/fog/CTL",
    "fogline/v1/site/fog/INFER",
    "fogline/v1/site/cloud/RELEASE",
    "fogline/v1/site/cloud/RELEASE/a/b",
    "fogline/v1/site/cloud/RELEASE/a b",
    "fogline/v1/site/fog/STATE/x",
    "fogline/v1/site/fog/CTL/a b",
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
