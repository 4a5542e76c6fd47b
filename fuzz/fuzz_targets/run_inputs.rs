#![no_main]
//! `flatpeak run`'s input parsing and the components behind it, on arbitrary bytes laid out as
//! `[component: u8][config length: u16 LE][config JSON][safetensors file]` (an empty config
//! means the defaults). A typed error or outputs, never a panic or an abort.

use std::path::Path;

use flatpeak::run::{TensorFile, run_parsed};
use libfuzzer_sys::fuzz_target;

const COMPONENTS: [&str; 4] = ["ring-dtp", "llep", "sco", "stream-adamw"];

fuzz_target!(|data: &[u8]| {
    let [component, l0, l1, rest @ ..] = data else { return };
    let len = usize::from(u16::from_le_bytes([*l0, *l1])).min(rest.len());
    let (config, tensors) = rest.split_at(len);
    let Ok(config) = std::str::from_utf8(config) else { return };
    let Ok(tensors) = TensorFile::parse(tensors, Path::new("inputs.safetensors")) else { return };
    let component = COMPONENTS[usize::from(*component) % COMPONENTS.len()];
    let config = (!config.is_empty()).then_some((config, Path::new("config.json")));
    let _ = run_parsed(component, &tensors, config);
});
