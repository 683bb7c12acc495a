//! Print the structured input a fuzz input file decodes to, then run it:
//! `cargo run --example show -- <target> <file>` (in fuzz/harness; stable works). A file of
//! `regressions/<target>/v1/` is in the target's first input format: name it `<target>/v1`.

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, target, file] = args.as_slice() else {
        eprintln!("usage: show <target> <file>");
        std::process::exit(2);
    };
    let data = std::fs::read(file).expect("readable input file");
    match omw_fuzz_harness::describe(target, &data) {
        Some(d) => println!("{d}"),
        None => println!("{target}: {} raw bytes: {data:?}", data.len()),
    }
    let run = match target.strip_suffix("/v1") {
        Some(t) => omw_fuzz_harness::TARGETS_V1.iter().find(|(n, _)| *n == t).expect("a target with a first format").1,
        None => omw_fuzz_harness::TARGETS.iter().find(|(n, _)| n == target).expect("known target").1,
    };
    println!("kept: {}", run(&data));
}
