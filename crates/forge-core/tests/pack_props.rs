//! Property tests: AWQ and GPTQ packing round-trips, with the packed words
//! checked against the layouts' definitions (nibble `i` of AWQ word
//! `[r, c]` holds column `8c + AWQ_ORDER[i]`; GPTQ packs 8 rows per word).
#![allow(clippy::unwrap_used)]

use forge_core::pack::{pack_awq, pack_gptq, unpack_awq, unpack_gptq, AWQ_ORDER};
use forge_core::{GridSpec, QMeta};
use half::f16;
use proptest::prelude::*;

/// `(k, n, group_size, codes K × N, qmeta N × K/G)` with asymmetric grids.
fn layer(min_zero: u8) -> impl Strategy<Value = (usize, usize, usize, Vec<u8>, Vec<QMeta>)> {
    (
        prop_oneof![Just(32usize), Just(64), Just(128)],
        1usize..=3,
        1usize..=4,
    )
        .prop_flat_map(move |(g, ng, nb)| {
            let (k, n) = (g * ng, 8 * nb);
            (
                Just(k),
                Just(n),
                Just(g),
                proptest::collection::vec(0u8..=15, k * n),
                proptest::collection::vec(
                    (-2000i16..2000, min_zero..=15u8).prop_map(|(s, z)| QMeta::new(s, z, 0)),
                    n * ng,
                ),
            )
        })
}

fn spec(g: usize) -> GridSpec {
    GridSpec {
        bits: 4,
        group_size: g,
        symmetric: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn awq_pack_unpack_round_trips((k, n, g, codes, qmeta) in layer(0)) {
        let t = pack_awq(&codes, &qmeta, k, n, &spec(g)).unwrap();
        let ng = k / g;
        prop_assert_eq!(t.qweight.len(), k * n / 8);
        for r in 0..k {
            for c in 0..n / 8 {
                let w = t.qweight[r * (n / 8) + c] as u32;
                for (i, &col) in AWQ_ORDER.iter().enumerate() {
                    prop_assert_eq!(((w >> (4 * i)) & 0xF) as u8, codes[r * n + 8 * c + col]);
                }
            }
        }
        for gi in 0..ng {
            for row in 0..n {
                let m = qmeta[row * ng + gi];
                prop_assert_eq!(t.scales[gi * n + row], f16::from_f32(m.scale()));
            }
        }
        let (codes2, zeros) = unpack_awq(&t.qweight, &t.qzeros, k, n, g).unwrap();
        prop_assert_eq!(codes2, codes);
        for gi in 0..ng {
            for row in 0..n {
                prop_assert_eq!(zeros[gi * n + row], qmeta[row * ng + gi].zero());
            }
        }
    }

    #[test]
    fn gptq_pack_unpack_round_trips((k, n, g, codes, qmeta) in layer(1)) {
        let t = pack_gptq(&codes, &qmeta, k, n, &spec(g)).unwrap();
        let ng = k / g;
        for rr in 0..k / 8 {
            for col in 0..n {
                let w = t.qweight[rr * n + col] as u32;
                for i in 0..8 {
                    prop_assert_eq!(((w >> (4 * i)) & 0xF) as u8, codes[(8 * rr + i) * n + col]);
                }
            }
        }
        prop_assert!(t.g_idx.iter().enumerate().all(|(kk, &gi)| gi as usize == kk / g));
        let (codes2, zeros) = unpack_gptq(&t.qweight, &t.qzeros, k, n, g).unwrap();
        prop_assert_eq!(codes2, codes);
        for gi in 0..ng {
            for row in 0..n {
                prop_assert_eq!(zeros[gi * n + row], qmeta[row * ng + gi].zero());
            }
        }
    }

    #[test]
    fn gptq_refuses_zero_point_zero((k, n, g, codes, mut qmeta) in layer(1), at in any::<prop::sample::Index>()) {
        let i = at.index(qmeta.len());
        qmeta[i] = QMeta::new(qmeta[i].log2_q88(), 0, 0);
        prop_assert!(pack_gptq(&codes, &qmeta, k, n, &spec(g)).is_err());
    }
}
