//! The blocking client on the loopback model: allocation, staged and zero-copy access,
//! atomics, and every misuse a type cannot prevent answered with a typed error.

use omw_client::model::{Model, ModelConfig};
use omw_client::{Cn, Error, Options, WaitPolicy};

fn model(cfg: ModelConfig) -> (Model, Cn<omw_client::model::ModelDevice>) {
    let m = Model::start(cfg).unwrap();
    let cn = Cn::connect(&m, Options::default()).unwrap();
    (m, cn)
}

#[test]
fn alloc_write_read_free_round_trip() {
    let (m, cn) = model(ModelConfig::default());
    let c = cn.alloc().unwrap();
    assert_eq!(m.free_groups().unwrap(), 63);
    let data: Vec<u8> = (0..c.size() as usize).map(|i| (i * 13) as u8).collect();
    cn.write(&c, 0, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    cn.read(&c, 0, &mut back).unwrap();
    assert_eq!(back, data);
    cn.free(c).unwrap();
    cn.progress().unwrap();
    assert_eq!(m.free_groups().unwrap(), 64);
}
