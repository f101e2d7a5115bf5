//! docs/api.yaml names every route of the table, with its method and body
//! fields, and nothing else.

use kemari_api::routes::ROUTES;

/// docs/api.yaml, read line by line: for each path, its methods, and
/// the required and other properties of its request body.
#[derive(Debug, Default)]
struct Documented {
    methods: Vec<String>,
    required: Vec<String>,
    properties: Vec<String>,
}

fn read_api_yaml() -> Vec<(String, Documented)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let mut paths: Vec<(String, Documented)> = Vec::new();
    let mut in_paths = false;
    let mut in_properties = None;
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim();
        if indent == 0 {
            in_paths = trimmed == "paths:";
            continue;
        }
        if !in_paths || trimmed.is_empty() {
            continue;
        }
        if indent == 2 {
            let p = trimmed.trim_end_matches(':').to_owned();
            paths.push((p, Documented::default()));
            in_properties = None;
            continue;
        }
        let Some((_, doc)) = paths.last_mut() else {
            continue;
        };
        if indent == 4 {
            doc.methods
                .push(trimmed.trim_end_matches(':').to_uppercase());
        } else if let Some(list) = trimmed.strip_prefix("required: [") {
            doc.required = list
                .trim_end_matches(']')
                .split(',')
                .map(|s| s.trim().to_owned())
                .collect();
        } else if trimmed == "properties:" {
            in_properties = Some(indent);
        } else if let Some(at) = in_properties {
            if indent <= at {
                in_properties = None;
            } else if indent == at + 2 {
                if let Some((name, _)) = trimmed.split_once(':') {
                    doc.properties.push(name.to_owned());
                }
            }
        }
    }
    paths
}

#[test]
fn docs_api_yaml_describes_every_route() {
    let documented = read_api_yaml();
    for r in ROUTES {
        let Some((_, doc)) = documented.iter().find(|(p, _)| p == r.path) else {
            panic!("docs/api.yaml does not name {}", r.path);
        };
        assert_eq!(
            doc.methods,
            vec![r.method.as_str()],
            "methods of {}",
            r.path
        );
        let required: Vec<_> = r
            .body
            .iter()
            .filter(|f| f.required)
            .map(|f| f.name)
            .collect();
        let all: Vec<_> = r.body.iter().map(|f| f.name).collect();
        assert_eq!(doc.required, required, "required body fields of {}", r.path);
        assert_eq!(doc.properties, all, "body fields of {}", r.path);
    }
    for (p, _) in &documented {
        assert!(
            ROUTES.iter().any(|r| r.path == p),
            "docs/api.yaml names {p}, which no route serves"
        );
    }
}
