"""gla_core.llo_schedule: reading libtpu's schedule dumps of a kernel (synthetic dumps in libtpu's
text format), and the dumps of a real compile for a compile-only TPU."""

from __future__ import annotations

import pathlib
import re

import pytest

from gla_core import llo_schedule, static_profile
from gla_core.cost import attention_problem, program_spec

# Ten bundles. Region 5 (bundles 1..8) holds the step body; bundle 3 branches over bundles 4 and 5
# to region 7 (a `pl.when` body not taken); bundle 8's comment runs over two lines; bundles 2 and
# 6 each spill one vector register, bundle 7 fills it back.
BUNDLES = """\
= control target key start
= control target key end

     0   :  { %s1_s0 = smov 0 }
   0x1   : > { %v2_v0 = vld [vmem:[%s3] sm:$0xff] } /* Start region 5 */
   0x2   : > { %4 = vst [vmem:[#allocation9_spill] sm:$0xff] /*vst_source=*/%v2_v0  ;;  %v5_v1 = vadd.f32 %v2_v0 }
   0x3   : > { %6 = sbr.rel (%p7_p0) target = $region7 }
   0x4   : > { %v8_v2 = vmul.f32 %v5_v1, %v5_v1 } /* Start region 6 */
   0x5   : > { %9 = vst [vmem:[#allocation10_spill] sm:$0xff] /*vst_source=*/%v8_v2 } /* End region 6 */
   0x6 PF: > { %10 = vst [vmem:[#allocation11_spill] sm:$0xff] /*vst_source=*/%v5_v1 } /* Start region 7 */
   0x7   : > { %v11_v3 = vld [vmem:[#allocation11_spill] sm:$0xff] } /* End region 7 */
   0x8   : > { %12 = vst [vmem:[%s13] sm:$0xff] /*vst_source=*/%v11_v3 } /* a comment
second_minor_factor: 1 */ } /* End region 5 */
   0x9   :  { %14 = vsyncpa [#allocation4], 1 }
"""

UTILIZATION = """\
== CAPACTIY:
MXU, VALU, VSTORE, SALU
    2     4     2     2
== UTILIZATION:
0 0 0 1
0 1 0 0
1 4 1 0
0 0 0 1
0 2 0 0
0 0 1 0
2 1 1 0
0 3 0 0
0 0 1 0
0 0 0 1
"""

CRITICAL_PATHS = """\

New basic block in region: region5 {members=8 hlo=k.1 parent=1}
  Length to end: 10, %v2 = vmatmul.mubr.bf16.gmra.mxu0 %v1
  Length to end: 7, %v5 = vadd.f32 %v2, %v2
  Length to end: 3, %v8 = vpop.f32.mrf.mxu0

New basic block in region: region9 {members=3 hlo=k.1 parent=5}
  Length to end: 50, %v20 = vadd.f32 %v19, %v19
"""

BODY = (1, 2, 3, 6, 7, 8)  # region 5 without the bundles the branch at 3 jumps over


def test_a_bundle_runs_on_over_lines_without_an_address():
    bundles = llo_schedule.bundle_lines(BUNDLES)
    assert len(bundles) == 10
    assert bundles[8].endswith("/* End region 5 */")


def test_a_bundle_out_of_address_order_is_an_error():
    with pytest.raises(llo_schedule.ScheduleError, match="bundle 1 expected, address 2 found"):
        llo_schedule.bundle_lines("     0   :  { }\n   0x2   :  { }\n")


def test_region_spans_and_the_bundles_a_forward_branch_skips():
    bundles = llo_schedule.bundle_lines(BUNDLES)
    spans = llo_schedule.region_spans(bundles)
    assert spans[5] == (1, 8) and spans[6] == (4, 5) and spans[7] == (6, 7)
    assert llo_schedule.skippable(bundles, spans, 1, 8) == {4, 5}
    assert llo_schedule.skippable(bundles, spans, 6, 8) == set()  # the branch lies outside the range


def test_utilization_and_critical_paths_are_parsed():
    utilization = llo_schedule.parse_utilization(UTILIZATION)
    assert utilization.units == ("MXU", "VALU", "VSTORE", "SALU")
    assert utilization.capacity == (2, 4, 2, 2)
    assert len(utilization.rows) == 10 and utilization.rows[2] == (1, 4, 1, 0)
    blocks = llo_schedule.parse_critical_paths(CRITICAL_PATHS)
    assert [(b.region, b.parent, b.length) for b in blocks] == [(5, 1, 10), (9, 5, 50)]


def test_summary_of_the_step_body():
    summary = llo_schedule.summarize("k.1", BUNDLES, UTILIZATION, CRITICAL_PATHS, step_cycles=20)
    assert summary.total_bundles == 10
    assert summary.body_bundles == len(BODY)
    assert summary.critical_path == 10  # region 9's chain (50) is longer than a step: not charged
    rows = [tuple(map(int, line.split())) for line in UTILIZATION.splitlines()[4:]]
    assert summary.unit_use["VALU"] == pytest.approx(sum(rows[i][1] for i in BODY) / len(BODY))
    assert summary.unit_use["MXU"] == pytest.approx(sum(rows[i][0] for i in BODY) / len(BODY))
    assert (summary.spill_stores, summary.spill_loads) == (2, 1)  # bundle 5's spill is skipped
    assert summary.chain_cycles == (("vadd.f32", 4), ("vmatmul.mubr", 3), ("vpop.f32", 3))
    assert summary.bound == "latency"  # a chain of 10 cycles over 6 bundles
    assert llo_schedule.ScheduleSummary.from_json(summary.to_json()) == summary


def test_a_body_with_a_short_chain_is_bound_by_its_busiest_unit():
    summary = llo_schedule.summarize("k.1", BUNDLES, UTILIZATION, CRITICAL_PATHS.replace(": 10,", ": 4,"), 20)
    assert summary.critical_path == 4
    assert summary.bound == "throughput: VALU"  # 9 of 24 VALU slots against 3 of 12 MXU slots


def test_dump_files_match_the_kernel_name_exactly(tmp_path):
    for name in ("kda_state", "kda_state_bwd"):
        for label in ("04-final_bundles", "03-final_hlo-static-per-bundle-utilization", "01-critical-path"):
            (tmp_path / f"123-{name}.1-{label}.txt").write_text(name)
    (tmp_path / "123-kda_state.1-02-schedule-analysis_final_bundles.txt").write_text("other")
    files = llo_schedule.dump_files(tmp_path, "kda_state")
    assert {key: path.read_text() for key, path in files.items()} == dict.fromkeys(files, "kda_state")
    assert files["bundles"].name == "123-kda_state.1-04-final_bundles.txt"
    with pytest.raises(llo_schedule.ScheduleError, match=re.escape("no '*-final_bundles.txt' dump")):
        llo_schedule.dump_files(pathlib.Path(tmp_path / "missing"), "kda_state")


@pytest.mark.tpu_compile
def test_schedule_of_every_kernel_of_a_small_training_step():
    problem = attention_problem("simple_gla", batch=1, seq_len=256, heads=2)
    spec = {**program_spec(problem, "train", "chunk"), "chip": "v6e"}
    kernels = static_profile.schedule_kernels(spec)
    assert len(kernels) >= 2 and all(k.cycles > 0 and k.steps >= 1 for k in kernels)
    for kernel in kernels:
        assert kernel.schedule is not None, kernel.schedule_error
        summary = llo_schedule.ScheduleSummary.from_json(kernel.schedule)
        assert 0 < summary.body_bundles <= summary.total_bundles
        assert summary.critical_path > 0 and summary.chain_cycles
        assert all(0 <= summary.unit_use[u] <= summary.unit_capacity[u] for u in summary.unit_use)
