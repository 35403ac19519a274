//! The server's startup checks of what `vl serve` is told: `--cors-origins` entries and the API
//! key, over generated variants.

use vl_server::{check_api_key, cors_origins};

fn list(entries: &[&str]) -> Vec<String> {
    entries.iter().map(|e| e.to_string()).collect()
}

#[test]
fn cors_entries_are_trimmed_lowercased_and_must_be_origins() {
    let blanks = ["", " ", "\t", "  \t", "\u{a0}"];
    for (i, lead) in blanks.iter().enumerate() {
        let trail = blanks[(i + 2) % blanks.len()];
        let got = cors_origins(&list(&[
            &format!("{lead}http://a.example{trail}"),
            &format!("{trail}HTTPS://B.Example:8443{lead}"),
            &format!("{lead}*"),
            "http://b.example:80",
            "https://c.example:443",
            "http://[::1]:8080",
            "http://127.0.0.1:3000",
            "app+x.y-z://host_1~",
        ]))
        .unwrap();
        assert_eq!(
            got,
            [
                "http://a.example",
                "https://b.example:8443",
                "*",
                "http://b.example",
                "https://c.example",
                "http://[::1]:8080",
                "http://127.0.0.1:3000",
                "app+x.y-z://host_1~"
            ]
        );
    }
    for bad in [
        "",
        " ",
        "http://a.example/",
        "http://a.example/x",
        "a.example",
        "http://",
        "://a.example",
        "1http://a.example",
        "http://a.example:",
        "http://a.example:65536",
        "http://a.example:123456",
        "http://a.example:-1",
        "http://u@a.example",
        "http://a example",
        "http://a.example?q",
        "http://a.example#f",
        "http://[]",
        "http://[::1",
        "http://[::1]x",
        "http://[g::1]",
        "**",
        "null",
        "http://ä.example",
    ] {
        let e = cors_origins(&list(&["http://ok.example", bad])).unwrap_err().to_string();
        if bad.trim().is_empty() {
            assert!(e.contains("empty entry"), "{bad:?}: {e}");
        } else {
            assert!(e.contains(&format!("{bad:?}")) && e.contains("not an origin"), "{bad:?}: {e}");
        }
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}

#[test]
fn api_keys_must_be_visible_ascii() {
    for key in ["k", "sekret", "s3kr3t-K3y_~!", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", &"x".repeat(4096)] {
        check_api_key(key).unwrap();
    }
    let e = check_api_key("").unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    for key in
        ["Zq Zq", " Zq", "Zq ", "Zq\t", "Zq\n", "Zq\u{7f}", "sekrét", "ключ", "\u{202e}Zq", "Zq\u{a0}", "Zq\u{0}"]
    {
        let e = check_api_key(key).unwrap_err().to_string();
        assert!(e.contains("visible ASCII"), "{key:?}: {e}");
        assert!(!e.contains(key), "the key is not echoed: {e}");
    }
}
