"""The PromQL reader the dashboard and alert checks rely on: it finds every metric, matcher and grouping
label, and mistakes none of the rest (functions, keywords, durations, numbers, strings) for one."""

from __future__ import annotations

import pytest

from tests.helm.promql import Matcher, PromQLError, parse


def test_a_histogram_quantile_reads_the_bucket_series_its_matchers_and_grouping():
    query = parse(
        'histogram_quantile(0.99, sum by (le, kind) (rate(x_seconds_bucket{namespace=~"$namespace", '
        'kind!="resume"}[$__rate_interval])))'
    )
    assert query.metrics == {"x_seconds_bucket"}
    assert query.selectors["x_seconds_bucket"] == [
        Matcher("namespace", "=~", "$namespace"),
        Matcher("kind", "!=", "resume"),
    ]
    assert query.grouping == {"le", "kind"}


def test_binary_operators_joins_and_bare_names():
    query = parse(
        "sum(rate(a_total[5m])) / ignoring(tier) group_left sum without (pod) (b_total offset 1h)"
        " > 0.5 and on (engine) c unless d{e='f'} * 1e3 or vector(1)"
    )
    assert query.metrics == {"a_total", "b_total", "c", "d"}
    assert query.selectors["d"] == [Matcher("e", "=", "f")]
    assert query.grouping == {"tier", "pod", "engine"}


def test_strings_and_durations_are_not_names():
    query = parse('label_replace(up{job="x"}, "dst", "$1", "src", "(.*)") > bool 2 offset 5m')
    assert query.metrics == {"up"}
    assert parse("max_over_time(g[1h:5m]) - 3").metrics == {"g"}


def test_escaped_quotes_and_commas_inside_matcher_values():
    [matcher] = parse('m{route=~"a,b|\\"c\\""}').selectors["m"]
    assert matcher == Matcher("route", "=~", 'a,b|"c"')


def test_grafana_label_values_queries():
    query = parse('label_values(chatmesh_router_decisions_total{job="r"}, namespace)')
    assert query.metrics == {"chatmesh_router_decisions_total"}
    assert query.grouping == {"namespace"}
    assert parse("label_values(namespace)").metrics == set()


@pytest.mark.parametrize("bad", ['{job="x"}', "sum(rate(a[5m])", 'a{job=x"}'])
def test_what_it_cannot_read_is_an_error_not_a_silent_pass(bad):
    with pytest.raises(PromQLError):
        parse(bad)
