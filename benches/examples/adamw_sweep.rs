//! Sweep link speeds for the stream-adamw pipeline (exploration aid):
//! `cargo run --release -p flatpeak-bench --example adamw_sweep -- PARAMS_M BUCKET_M GBPS GRADS`
use flatpeak_bench::components::stream_adamw::{Workload, measure_pipeline};
use flatpeak_common::{CountingAllocator, DType};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: f64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let grads = if args.get(3).map(String::as_str) == Some("bf16") { DType::Bf16 } else { DType::F32 };
    let w = Workload {
        params: (num(0, 64.0) * (1 << 20) as f64) as usize,
        bucket: (num(1, 2.0) * (1 << 20) as f64) as usize,
        link_gbps: num(2, 6.0),
        link_name: "sweep",
        grads,
    };
    match measure_pipeline(&w, 5) {
        Ok(m) => {
            let (a, c, h) = m.a_c_h_ms;
            let ideal = stream_adamw::ideal_speedup(a, c, h);
            let s = m.serial_ms / m.pipelined_ms;
            println!(
                "{}: serial {:.1} ms pipe {:.1} ms speedup {s:.2} ideal {ideal:.2} eff {:.2} a {a:.2} c {c:.2} h {h:.2}",
                w.describe(),
                m.serial_ms,
                m.pipelined_ms,
                s / ideal
            );
        }
        Err(e) => eprintln!("error: {e}"),
    }
}
