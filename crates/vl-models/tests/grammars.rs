//! Grammars beyond JSON on the tiny random-weight checkpoint: regular expressions, lists of
//! choices, Lark and llama.cpp's GBNF. Sampled answers (seeded) must match what each constraint
//! admits, checked by the `regex` crate against a regex written here by hand for the same
//! language; broken constraints are refused at admission naming the failing part.

mod common;

use common::*;
use vl_models::constraint::GrammarSyntax;
use vl_models::engine::{Constraint, Engine, EngineOptions, Finish, ModelOptions};

fn engine() -> Engine {
    let opts = EngineOptions { model: ModelOptions { device: device(), ..Default::default() }, ..Default::default() };
    Engine::load(&goldens().join("tiny-a").join("checkpoint"), opts).unwrap()
}

fn grammar(text: &str) -> Constraint {
    Constraint::Grammar { text: text.into(), syntax: GrammarSyntax::detect(text) }
}

#[test]
fn regex_choice_lark_and_gbnf_answers_match_their_language() {
    let e = engine();
    // (constraint, the same language as an anchored regex)
    let cases: Vec<(Constraint, &str)> = vec![
        (Constraint::Regex(r"[a-z]{2,8}(-[0-9]{1,3}){1,3}".into()), r"^[a-z]{2,8}(-[0-9]{1,3}){1,3}$"),
        (Constraint::Regex(r"^(yes|no), [A-Z][a-z]{0,5}\.$".into()), r"^(yes|no), [A-Z][a-z]{0,5}\.$"),
        (
            Constraint::Choice(vec!["red".into(), "green".into(), "blue violet".into(), "bluebird".into()]),
            r"^(red|green|blue violet|bluebird)$",
        ),
        (
            grammar("start: \"(\" num (\",\" \" \"? num){0,3} \")\"\nnum: /[1-9][0-9]{0,2}/ | \"0\"\n"),
            r"^\(([1-9][0-9]{0,2}|0)(, ?([1-9][0-9]{0,2}|0)){0,3}\)$",
        ),
        (
            grammar("root ::= greeting \" \" name \"!\"\ngreeting ::= \"hi\" | \"hello\"\nname ::= [A-Z] [a-z]{1,6}\n"),
            r"^(hi|hello) [A-Z][a-z]{1,6}!$",
        ),
        (
            grammar("# angle brackets around a word\nroot ::= \"<\" [^<>\\n]{1,12} \">\" (\" \" . \".\")?\n"),
            r"^<[^<>\n]{1,12}>( (?s:.)\.)?$",
        ),
        // A run that may swallow the text after it (per-character lexemes), and one that may not
        // (one lexeme).
        (grammar("root ::= [a-c]{1,5} \"c!\" \" \" \"'\" [^'\\n]{0,15} \"'\"\n"), r"^[a-c]{1,5}c! '[^'\n]{0,15}'$"),
    ];
    for (i, (c, want)) in cases.iter().enumerate() {
        let re = regex::Regex::new(want).unwrap();
        let mut distinct = std::collections::BTreeSet::new();
        for seed in 0..6u64 {
            let mut req = golden_request("text_only", 60);
            req.options.temperature = 1.0;
            req.options.seed = seed;
            req.constraint = Some(c.clone());
            let mut streamed = String::new();
            let out = e
                .generate(&req, &mut |d| {
                    streamed.push_str(d);
                    true
                })
                .unwrap();
            assert_eq!(out.finish, Finish::Stop, "case {i} seed {seed}: {:?}", out.text);
            assert!(re.is_match(&out.text), "case {i} seed {seed}: {:?} is not in {want}", out.text);
            assert_eq!(streamed, out.text, "case {i} seed {seed}");
            distinct.insert(out.text);
        }
        println!("case {i}: {distinct:?}");
        // Sampling explores the language, not one fixed string.
        assert!(distinct.len() >= 2, "case {i}: every seed answered {distinct:?}");
    }
}

#[test]
fn broken_regexes_choices_and_grammars_are_refused_naming_the_part() {
    let e = engine();
    let cases: Vec<(Constraint, &str)> = vec![
        (Constraint::Regex("(a".into()), "the regex cannot be read"),
        (Constraint::Regex("(a{300}){300}".into()), "the regex spells out up to 90000 characters"),
        (Constraint::Choice(vec![]), "no choice given"),
        (Constraint::Choice(vec!["a".into(), String::new()]), "choice 1 is empty"),
        (grammar("root ::= foo\n"), "line 1: rule `root` uses `foo`, which is never defined"),
        (grammar("root ::= \"a\" root\n"), "Too many items"),
        (grammar("start: \"a\" missing\n"), "missing"),
        (grammar("x".repeat(300 << 10).as_str()), "over the limit of 262144"),
    ];
    for (i, (c, want)) in cases.iter().enumerate() {
        let mut req = golden_request("text_only", 8);
        req.constraint = Some(c.clone());
        let err = e.generate(&req, &mut |_| true).unwrap_err();
        let msg = err.to_string();
        println!("case {i}: {msg}");
        assert!(matches!(&err, vl_models::Error::Input { what, .. } if what == "response_format"), "case {i}: {err:?}");
        assert!(msg.contains(want), "case {i}: {msg:?} does not say {want:?}");
    }
}

#[test]
fn the_grammar_syntax_is_told_by_its_rules() {
    assert_eq!(GrammarSyntax::detect("root ::= \"a\"\n"), GrammarSyntax::Gbnf);
    assert_eq!(GrammarSyntax::detect("# c\n  my-rule::= [a-z]\nroot ::= my-rule"), GrammarSyntax::Gbnf);
    assert_eq!(GrammarSyntax::detect("start: \"a\" | \"b\"\n"), GrammarSyntax::Lark);
    assert_eq!(GrammarSyntax::detect("%llguidance {}\nstart: x\nx ::= \"a\""), GrammarSyntax::Lark);
    assert_eq!(GrammarSyntax::detect("start: \"::=\"\n"), GrammarSyntax::Lark);
}
