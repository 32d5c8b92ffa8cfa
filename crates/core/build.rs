//! Compiles the repository's `proto/` into Rust with prost. The schema lives at the top of the
//! repository, where producers in other languages look for it; this crate reads it from
//! there. The .proto files are parsed by protox (a protobuf compiler written in Rust), so
//! building replyd needs no `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../../proto");
    let descriptors = protox::compile(["replyd/v1/reply_task.proto"], ["../../proto"])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
