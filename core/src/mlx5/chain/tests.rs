use super::*;
use crate::alloc_chain::build_alloc_chain;
use crate::chain_builder::test_env;
use crate::free_chain::build_free_chain;

fn queues() -> Mlx5Queues {
    Mlx5Queues { cqns: [0x21, 0x22, 0x23], ring_bases: [0x5_0000_0000, 0x5_0010_0000] }
}

#[test]
fn smoke() {
    for g in 2..=4 {
        let env = test_env(4096, 16, g);
        for l in [build_alloc_chain(&env).unwrap(), build_free_chain(&env).unwrap()] {
            let c = Mlx5Chain::build(&l, &env, queues());
            match c {
                Ok(c) => std::println!("{:?} G={g}: {:?}", l.kind, c.lap_cost()),
                Err(e) => panic!("{:?} G={g}: {e}", l.kind),
            }
        }
    }
}
