//! Proptest strategies for hostile-input tests (feature `test-strategies`): arbitrary JSON, as a client could send.

use proptest::prelude::*;
use serde_json::Value;

/// Any JSON value up to `depth` levels, with strings drawn from the regex `strings`.
pub fn arb_json(depth: u32, strings: &'static str) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        strings.prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}
