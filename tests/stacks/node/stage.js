// Stage jobs through drain_stage_v1 and drain_stage_v2 with the `pg` package; see ../README.md for the protocol.
'use strict';
const readline = require('readline');
const { Client } = require('pg');

async function main() {
  const [dsn, queue] = process.argv.slice(2);
  const client = new Client({ connectionString: dsn });
  await client.connect();
  let open = false;
  const lines = readline.createInterface({ input: process.stdin });
  for await (const line of lines) {
    const [command, marker, key] = line.trim().split(' ');
    if (command === 'stage') {
      if (!open) { await client.query('BEGIN'); open = true; }
      const result = await client.query(
        'SELECT drain_stage_v1($1, $2::jsonb, queue => $3) AS job_id',
        ['tests.support.tasks.record', JSON.stringify([marker]), queue]);
      console.log(`staged ${result.rows[0].job_id}`);
    } else if (command === 'stage-keyed') {
      if (!open) { await client.query('BEGIN'); open = true; }
      const result = await client.query(
        'SELECT drain_stage_v2($1, $2::jsonb, queue => $3, ordering_key => $4) AS job_id',
        ['tests.support.tasks.record', JSON.stringify([marker]), queue, key]);
      console.log(`staged ${result.rows[0].job_id}`);
    } else if (command === 'commit' || command === 'rollback') {
      await client.query(command.toUpperCase());
      open = false;
      console.log('ok');
    } else if (command === 'bad' || command === 'bad-key') {
      await client.query('BEGIN');
      try {
        await client.query(command === 'bad' ? "SELECT drain_stage_v1('')"
          : "SELECT drain_stage_v2('a.b', ordering_key => '')");
        console.log('error none');
      } catch (err) {
        console.log(`error ${err.message}`);
      }
      await client.query('ROLLBACK');
    }
  }
  await client.end();
}

main().catch((err) => { console.error(err); process.exit(1); });
