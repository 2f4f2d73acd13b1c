# Stage jobs through drain_stage_v1 and drain_stage_v2 with Debian's ruby-pg; see ../README.md for the protocol.
require 'json'
require 'pg'

dsn, queue = ARGV
$stdout.sync = true
$stdin.set_encoding('UTF-8') # the keys are UTF-8 whatever the locale says
conn = PG.connect(dsn)
open = false
$stdin.each_line do |line|
  command, marker, key = line.split
  case command
  when 'stage'
    unless open
      conn.exec('BEGIN')
      open = true
    end
    result = conn.exec_params('SELECT drain_stage_v1($1, $2::jsonb, queue => $3) AS job_id',
                              ['tests.support.tasks.record', [marker].to_json, queue])
    puts "staged #{result[0]['job_id']}"
  when 'stage-keyed'
    unless open
      conn.exec('BEGIN')
      open = true
    end
    result = conn.exec_params('SELECT drain_stage_v2($1, $2::jsonb, queue => $3, ordering_key => $4) AS job_id',
                              ['tests.support.tasks.record', [marker].to_json, queue, key])
    puts "staged #{result[0]['job_id']}"
  when 'commit', 'rollback'
    conn.exec(command.upcase)
    open = false
    puts 'ok'
  when 'bad', 'bad-key'
    conn.exec('BEGIN')
    begin
      conn.exec(command == 'bad' ? "SELECT drain_stage_v1('')" : "SELECT drain_stage_v2('a.b', ordering_key => '')")
      puts 'error none'
    rescue PG::Error => e
      puts "error #{e.message.lines.first.strip}"
    end
    conn.exec('ROLLBACK')
  end
end
conn.close
